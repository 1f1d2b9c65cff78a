"""The runner's Prometheus metrics: per running batch, its progress. A batch's series
are dropped when it ends (its document in the store keeps the final figures), so the
label values stay bounded by the batches running now."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from schemas.batches import BatchDoc

__all__ = ["CONTENT_TYPE_LATEST", "RunnerMetrics"]
LABELS = ["tenant", "batch"]


@dataclass
class RunnerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.lines = Gauge(
            "tokenbus_batch_lines", "Lines of a running batch, by state", [*LABELS, "state"],
            registry=r,
        )  # fmt: skip
        self.tokens = Gauge(
            "tokenbus_batch_tokens", "Tokens of a running batch's finished lines",
            [*LABELS, "kind"], registry=r,
        )  # fmt: skip
        self.eta = Gauge("tokenbus_batch_eta_seconds", "Time to completion", LABELS, registry=r)
        self.running = Gauge("tokenbus_batches_running", "Batches this runner drives", registry=r)
        self.pacer_limit = Gauge(
            "tokenbus_batch_pacer_limit",
            "Lines the runner's batches may keep in flight together (the AIMD pacer's limit)",
            registry=r,
        )

    def observe(self, doc: BatchDoc, num_left: int) -> None:
        counts = doc.request_counts
        labels = (doc.tenant, doc.id)
        for state, value in (
            ("completed", counts.completed),
            ("failed", counts.failed),
            ("remaining", num_left),
            ("in_flight", doc.in_flight),
        ):
            self.lines.labels(*labels, state).set(value)
        self.tokens.labels(*labels, "prompt").set(doc.usage.input_tokens)
        self.tokens.labels(*labels, "completion").set(doc.usage.output_tokens)
        self.eta.labels(*labels).set(-1 if doc.eta_s is None else doc.eta_s)

    def forget(self, tenant: str, batch_id: str) -> None:
        for state in ("completed", "failed", "remaining", "in_flight"):
            _remove(self.lines, tenant, batch_id, state)
        for kind in ("prompt", "completion"):
            _remove(self.tokens, tenant, batch_id, kind)
        _remove(self.eta, tenant, batch_id)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass
