"""The bridge's Prometheus metrics, on a registry of its own (one per app, so tests
can build many apps in one process), in the shared vocabulary (tokenbus.metrics).

Label values are bounded: endpoint and status come from the routes, code from the
error codes, model from the served models, and tenant from ``TenantLabels`` (the top N
tenants by recent traffic, the rest ``other``; an evicted tenant's series are dropped).

Hot path: one labelled child is looked up per request, never per token; a stream's
inter-token latency is observed once, at its end, as the mean gap over its decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenbus.metrics import (
    ITL_BUCKETS,
    REQUEST_LABELS,
    TTFT_BUCKETS,
    TenantLabels,
    drop_tenant_series,
)

__all__ = ["CONTENT_TYPE_LATEST", "BridgeMetrics"]


@dataclass
class BridgeMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    tenants: TenantLabels = field(default_factory=lambda: TenantLabels(20))

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "tokenbus_bridge_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.completions = Counter(
            "tokenbus_bridge_completions",
            "Completions answered, by outcome: ok, or the error code",
            [*REQUEST_LABELS, "code"],
            registry=r,
        )
        self.tokens_relayed = Counter(
            "tokenbus_bridge_tokens_relayed",
            "Completion tokens written to clients",
            ["tenant"],
            registry=r,
        )
        self.cancels = Counter(
            "tokenbus_bridge_cancels",
            "Requests cancelled on the bus, by reason",
            ["reason"],
            registry=r,
        )
        self.flags = Counter(
            "tokenbus_bridge_flags", "Requests flagged by input hygiene", ["flag"], registry=r
        )
        self.active_streams = Gauge(
            "tokenbus_bridge_active_streams", "SSE streams open now", registry=r
        )
        self.ttft = Histogram(
            "tokenbus_bridge_ttft_seconds",
            "From the request received to its first chunk from the bus",
            REQUEST_LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tokenbus_bridge_itl_seconds",
            "Mean time between tokens over a response, first chunk to last",
            REQUEST_LABELS,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tenants.on_evict(
            drop_tenant_series(self.completions, self.tokens_relayed, self.ttft, self.itl)
        )

    def labels(self, tenant: str, model: str, priority: int) -> tuple[str, str, str]:
        """The request's label values (notes the tenant's traffic: once per request)."""
        return (self.tenants.label(tenant), model, str(priority))

    def render(self) -> bytes:
        return generate_latest(self.registry)
