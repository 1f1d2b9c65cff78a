"""The bridge's Prometheus metrics, on a registry of its own (one per app, so tests
can build many apps in one process). Label values are bounded: endpoint and status
come from the routes, tenant from the tenant directory or verified tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "BridgeMetrics"]


@dataclass
class BridgeMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "tokenbus_bridge_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
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
            "tokenbus_bridge_time_to_first_chunk_seconds",
            "From request received to first chunk from the bus",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
