"""The worker's Prometheus metrics, in the shared vocabulary (tokenbus.metrics).

# a request's end --> WorkerMetrics.request_done --> requests, tokens, TTFT, ITL
# an abort --> cancel_trip (bus) ; WorkerMetrics.cancelled --> tokens after the cancel
# scrape --> the engine's scheduler stats (running, waiting, KV use, tokens/s)
#        --> the lag of the worker's request topic (tokenbus.metrics.ConsumerLagCollector)
# --> /metrics and /healthz on worker_metrics_port (tokenbus.metrics.metrics_app)

Times are the worker loop's own: TTFT from the loop taking the request to its first
token (the engine's queue and prefill; the bus and the job's queue are the bridge's
TTFT), ITL the mean gap between tokens after the first, over the request's decode.
Everything is observed once per request, at its end: nothing per token or per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenbus.metrics import (
    ITL_BUCKETS,
    MODEL,
    REQUEST_LABELS,
    TTFT_BUCKETS,
    WORKER,
    ConsumerLagCollector,
    TenantLabels,
    aiokafka_offsets,
    drop_tenant_series,
)
from workers.interface import Engine

_LABELS = (*REQUEST_LABELS, WORKER)
CANCEL_TRIP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKENS_AFTER_CANCEL_BUCKETS = (0, 1, 2, 4, 8, 16, 64, 256)


class _EngineCollector(Collector):
    """The engine's scheduler, as its last step reported it, read at scrape time."""

    def __init__(self, engine: Engine, worker: str) -> None:
        self._engine = engine
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        values = [self._engine.model_name, self._worker]
        for name, documentation, value in (
            ("num_running", "requests running in the engine", stats.num_running),
            ("num_waiting", "requests waiting in the engine's queue", stats.num_waiting),
            ("kv_cache_usage", "KV cache in use (0-1)", stats.kv_cache_usage),
            ("tokens_per_s", "tokens generated per second", stats.tokens_per_s),
            ("max_num_seqs", "seats: requests the engine runs at once", self._engine.max_num_seqs),
        ):
            family = GaugeMetricFamily(
                f"tokenbus_worker_{name}", documentation, labels=[MODEL, WORKER]
            )
            family.add_metric(values, value)
            yield family


class WorkerMetrics:
    def __init__(
        self,
        worker: str,
        engine: Engine,
        tenants: TenantLabels,
        request_consumer: Callable[[], Any],
        request_topic: str,
    ) -> None:
        self.worker = worker
        self.tenants = tenants
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "tokenbus_worker_requests",
            "Requests ended, by finish reason",
            [*_LABELS, "finish"],
            registry=r,
        )
        self.tokens = Counter(
            "tokenbus_worker_tokens_generated",
            "Completion tokens generated (rate(): tokens/s by tenant and model)",
            _LABELS,
            registry=r,
        )
        self.ttft = Histogram(
            "tokenbus_worker_ttft_seconds",
            "From the worker taking a request to its first token (engine queue and prefill)",
            _LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenbus_worker_itl_seconds",
            "Mean time between tokens after the first, per request",
            _LABELS,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.batch_pauses = Counter(
            "tokenbus_worker_batch_pauses",
            "Class 2 lines paused by the batch gate for interactive work (each goes on later)",
            [MODEL, WORKER],
            registry=r,
        )
        self.batch_probes = Counter(
            "tokenbus_worker_batch_probes",
            "The batch gate's learner: lines let in beside interactive work (probe), probes"
            " that held or failed, halvings outside a probe (workers.batch_gate.SeatLearner)",
            [MODEL, WORKER, "step"],
            registry=r,
        )
        self.batch_seats = Gauge(
            "tokenbus_worker_batch_seats",
            "Class 2 lines the batch gate lets run beside interactive work, as learned",
            [MODEL, WORKER],
            registry=r,
        )
        self.batch_waiting = Gauge(
            "tokenbus_worker_batch_lines_waiting",
            "Class 2 lines waiting at the batch gate (new or paused)",
            [MODEL, WORKER],
            registry=r,
        )
        self.cancel_trip = Histogram(
            "tokenbus_worker_cancel_trip_seconds",
            "From a cancel being written to the aborts topic (by a bridge or the job) to the"
            " worker aborting the running request: the bus's share of a cancel's cost",
            [MODEL, WORKER],
            buckets=CANCEL_TRIP_BUCKETS,
            registry=r,
        )
        self.tokens_after_cancel = Histogram(
            "tokenbus_worker_tokens_after_cancel",
            "Tokens a cancelled request streamed after its cancel reached the worker:"
            " the engine's step in flight (billed, never sent to a client that left)",
            _LABELS,
            buckets=TOKENS_AFTER_CANCEL_BUCKETS,
            registry=r,
        )
        tenants.on_evict(
            drop_tenant_series(
                self.requests, self.tokens, self.ttft, self.itl, self.tokens_after_cancel
            )
        )
        r.register(_EngineCollector(engine, worker))
        lag = ConsumerLagCollector()
        lag.track("requests", aiokafka_offsets(request_consumer, [request_topic]))
        r.register(lag)

    def batch_learned(self, model: str, steps: Iterable[str]) -> None:
        """What the batch gate's learner did on one interactive request's first token."""
        for step in steps:
            self.batch_probes.labels(model, self.worker, step).inc()

    def request_done(
        self,
        tenant: str,
        model: str,
        priority: int,
        finish: str,
        num_tokens: int,
        ttft_s: float | None,
        itl_s: float | None,
    ) -> None:
        labels = (self.tenants.label(tenant), model, str(priority), self.worker)
        self.requests.labels(*labels, finish).inc()
        if num_tokens:
            self.tokens.labels(*labels).inc(num_tokens)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        if itl_s is not None:
            self.itl.labels(*labels).observe(itl_s)

    def cancelled(self, tenant: str, model: str, priority: int, tokens_after: int) -> None:
        """A running request was aborted: the tokens it made once the worker had the cancel."""
        labels = (self.tenants.label(tenant), model, str(priority), self.worker)
        self.tokens_after_cancel.labels(*labels).observe(tokens_after)
