"""One metrics vocabulary for every service: label names, buckets, bounded tenants, lag.

# a request's tenant --> TenantLabels.label (top-N by decayed recent traffic, else "other")
# an aiokafka or Faust consumer --> PartitionOffsets --> ConsumerLagCollector --> /metrics
# a registry --> metrics_app (aiohttp /metrics and /healthz) for services without a web app

Every service labels what it counts about requests with the same names (``tenant``,
``model``, ``priority``, ``worker``) and draws its latency histograms on the same
buckets, so one query sums or compares them across the bridge, the job and the workers.
prometheus_client only: it is in both service environments (vLLM brings it to the
worker's). README.md, "Metrics", lists each metric.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

TENANT, MODEL, PRIORITY, WORKER = "tenant", "model", "priority", "worker"
"""The shared label names."""
REQUEST_LABELS = (TENANT, MODEL, PRIORITY)
"""What every per-request series of every service is labelled with."""
OTHER = "other"
"""The tenant label of every tenant outside the top N."""

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
"""Seconds to the first token: the bridge's, the worker's (and the dashboard's quantiles)."""
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
"""Seconds between tokens, as a request's mean over its decode."""


class TenantLabels:
    """Bounded cardinality for the ``tenant`` label: the N tenants with the most recent
    traffic keep their name, every other tenant is ``other``. Pure: a clock is injected.

    Traffic is a count decayed with a half-life (``half_life_s``), kept as a forward-decayed
    score (each note adds ``2 ** ((now - origin) / half_life)``), so scores compare
    without being decayed one by one. A tenant outside the top set takes the place of
    the weakest member only once its score beats that member's by ``margin`` notes'
    worth at that moment: a flood of one-request tenants does not churn the set. At most
    ``max_tracked`` scores are kept; past that, the weakest untracked half is forgotten.

    ``on_evict`` hears each tenant that leaves the top set, so its series can be dropped:
    a service's label values stay at N names plus ``other`` however many tenants come."""

    def __init__(
        self,
        top_n: int,
        *,
        half_life_s: float = 300.0,
        margin: float = 1.0,
        max_tracked: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.top_n = max(0, top_n)
        self._half_life_s = half_life_s
        self._margin = margin
        self._max_tracked = max(max_tracked or 8 * self.top_n, self.top_n + 1)
        self._clock = clock
        self._origin = clock()
        self._scores: dict[str, float] = {}
        self._top: set[str] = set()
        self._listeners: list[Callable[[str], None]] = []

    def on_evict(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def label(self, tenant: str) -> str:
        """Notes one request of ``tenant`` and returns its label now."""
        weight = self._weight()
        scores = self._scores
        scores[tenant] = scores.get(tenant, 0.0) + weight
        top = self._top
        if tenant in top:
            return tenant
        if len(top) < self.top_n:
            top.add(tenant)
            return tenant
        if self.top_n:
            weakest = min(top, key=scores.__getitem__)
            if scores[tenant] > scores[weakest] + self._margin * weight:
                top.discard(weakest)
                top.add(tenant)
                for listener in self._listeners:
                    listener(weakest)
                return tenant
        if len(scores) > self._max_tracked:
            self._forget_weakest()
        return tenant if tenant in top else OTHER

    def current(self) -> frozenset[str]:
        """The label values in use now: the top set, and ``other``."""
        return frozenset(self._top | {OTHER})

    def _weight(self) -> float:
        exponent = (self._clock() - self._origin) / self._half_life_s
        if exponent > 512:  # keeps the scores far from overflow; their order is unchanged
            shift = math.exp2(exponent)
            self._scores = {t: s / shift for t, s in self._scores.items()}
            self._origin = self._clock()
            exponent = 0.0
        return math.exp2(exponent)

    def _forget_weakest(self) -> None:
        outside = sorted((s, t) for t, s in self._scores.items() if t not in self._top)
        for _, tenant in outside[: len(outside) // 2 + 1]:
            del self._scores[tenant]


def create_tenant_labels(
    top_n: int, half_life_s: float, clock: Callable[[], float] = time.monotonic
) -> TenantLabels:
    """The policy from configuration (``metrics_top_tenants``, ``metrics_tenant_half_life_s``)."""
    return TenantLabels(top_n, half_life_s=half_life_s, clock=clock)


def drop_tenant_series(*metrics: Any) -> Callable[[str], None]:
    """An ``on_evict`` listener: removes the evicted tenant's series from ``metrics``
    (prometheus_client metrics with a ``tenant`` label)."""

    def drop(tenant: str) -> None:
        for metric in metrics:
            metric.remove_by_labels({TENANT: tenant})

    return drop


# -- consumer lag --------------------------------------------------------------------------
class PartitionOffsets(NamedTuple):
    topic: str
    partition: int
    end: int | None
    """The high-water mark: the offset the next record produced will get."""
    position: int | None
    """The offset of the next record this consumer will read."""


def partition_lag(offsets: PartitionOffsets) -> int | None:
    """Records between the consumer's position and the end; None while either is unknown."""
    if offsets.end is None or offsets.position is None:
        return None
    return max(0, offsets.end - offsets.position)


OffsetsSource = Callable[[], Iterable[PartitionOffsets]]


def aiokafka_offsets(
    consumer_of: Callable[[], Any], topics: Iterable[str] | None = None
) -> OffsetsSource:
    """The offsets of an ``AIOKafkaConsumer``'s (``consumer_of()``, None before it is
    made) assigned partitions, ``topics`` only if given, read without I/O at
    scrape time: the high-water mark the last fetch response reported (``highwater``)
    and the fetch position. (aiokafka's ``position`` is a coroutine; its partition
    state holds the same number, read here as its own ``position`` reads it.)"""
    wanted = set(topics) if topics is not None else None

    def read() -> list[PartitionOffsets]:
        consumer = consumer_of()
        if consumer is None:
            return []
        try:
            assignment = consumer.assignment()
            state_of = consumer._subscription.subscription.assignment.state_value
        except Exception:  # not started, stopped, or between assignments
            return []
        rows = []
        for tp in sorted(assignment):
            if wanted is not None and tp.topic not in wanted:
                continue
            state = state_of(tp)
            if state is None:
                continue
            position = state.position if state.has_valid_position else None
            rows.append(PartitionOffsets(tp.topic, tp.partition, state.highwater, position))
        return rows

    return read


class ConsumerLagCollector(Collector):
    """``tokenbus_consumer_lag_records{consumer, topic, partition}``: end offset minus
    position, for every partition of every consumer tracked, computed at scrape time.

    On the bundled broker (tansu) the high-water mark a fetch reports can trail the end
    by the records of its last batch; on Apache Kafka it is exact."""

    def __init__(self) -> None:
        self._sources: dict[str, OffsetsSource] = {}

    def track(self, consumer: str, offsets: OffsetsSource) -> None:
        self._sources[consumer] = offsets

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tokenbus_consumer_lag_records",
            "Records between a consumer's position and the partition's end",
            labels=["consumer", "topic", "partition"],
        )
        for consumer, source in sorted(self._sources.items()):
            for offsets in source():
                lag = partition_lag(offsets)
                if lag is not None:
                    family.add_metric([consumer, offsets.topic, str(offsets.partition)], lag)
        yield family


# -- serving ----------------------------------------------------------------------------------
def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus's text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def metrics_app(registry: CollectorRegistry, health: Callable[[], dict[str, Any]]) -> Any:
    """A small aiohttp app: ``/metrics`` and ``/healthz``, for services with no web server
    of their own (the worker, the batch runner, the alerts service)."""
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = render(registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response(health())

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


async def start_metrics_server(app: Any, host: str, port: int) -> Any:
    """Serves ``app`` on ``host:port``; the caller awaits ``runner.cleanup()``."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
