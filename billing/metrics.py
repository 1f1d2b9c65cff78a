"""The billing process's Prometheus metrics, read from the sinks' plain counts at scrape.

# BillingSink (rows inserted, duplicates, dead letters, newest created_at) --> BillingCollector
# the usage topic's consumer --> ConsumerLagCollector (tokenbus.metrics)
# --> a registry of its own --> /metrics on the query server

Billing lag is ``now - the newest created_at stored``: how far behind the requests'
own time the table is. With no traffic it grows; read it beside the usage consumer's
lag (records), which is 0 when the sink has simply caught up with an idle topic. Under
steady light traffic it also saws by up to ``billing_insert_gap_s`` (5 s): the sink then
inserts once per gap (``billing.sink.close_at``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenbus.metrics import ConsumerLagCollector, OffsetsSource


class SinkCounts(Protocol):
    newest_created_at: float | None

    def stats(self) -> dict[str, int]: ...


_COUNTERS = {
    "num_inserted": ("tokenbus_billing_rows_inserted", "usage rows written, each attempt once"),
    "num_duplicates": ("tokenbus_billing_duplicates", "copies of attempts already stored"),
    "num_batches": ("tokenbus_billing_batches", "batches inserted and committed"),
    "num_dead_letters": ("tokenbus_billing_dead_letters", "usage records dead-lettered"),
    "num_write_failures": ("tokenbus_billing_write_failures", "failed writes, each retried"),
    "num_commit_failures": ("tokenbus_billing_commit_failures", "failed offset commits"),
}


class BillingCollector(Collector):
    def __init__(
        self,
        sink: SinkCounts,
        extra: Callable[[], Mapping[str, int]] = dict,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sink = sink
        self._extra = extra
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        stats = self._sink.stats()
        for key, (name, documentation) in _COUNTERS.items():
            yield CounterMetricFamily(name, documentation, value=stats.get(key, 0))
        for key, value in sorted(self._extra().items()):
            yield CounterMetricFamily(
                f"tokenbus_billing_{key.removeprefix('num_')}", f"billing's {key}", value=value
            )
        lag = GaugeMetricFamily(
            "tokenbus_billing_lag_seconds",
            "now minus the newest created_at stored (absent before the first insert)",
        )
        newest = self._sink.newest_created_at
        if newest is not None:
            lag.add_metric([], max(0.0, self._clock() - newest))
        yield lag


def billing_registry(
    sink: SinkCounts,
    usage_offsets: OffsetsSource,
    extra: Callable[[], Mapping[str, int]] = dict,
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BillingCollector(sink, extra))
    lag = ConsumerLagCollector()
    lag.track("billing_usage", usage_offsets)
    registry.register(lag)
    return registry
