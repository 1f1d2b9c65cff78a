"""The daily reconciliation, in the alerts service: drift --> log and ``/metrics``.

# every budget_reconcile_interval_s: job /budgets + ClickHouse --> billing.alerts.reconcile
# --> a warning per drifting bucket, gauges for /metrics

Reads ClickHouse through the billing sink's query server (or a server DSN), never by
opening the sink's chdb directory (``open_reader(borrow_directory=False)``): a failed
run (job or sink not answering) is logged, counted, and tried again next interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from decimal import Decimal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from billing.alerts.reconcile import Drift, reconcile
from billing.reader import open_reader
from tokenbus.budget_admin import job_budgets
from tokenbus.config import Settings

log = logging.getLogger(__name__)


class ReconcileMetrics(Collector):
    def __init__(self) -> None:
        self.num_runs = 0
        self.num_failures = 0
        self.num_buckets = 0
        self.last_success_at = 0.0
        self.drifts: list[Drift] = []

    def record(self, num_buckets: int, drifts: list[Drift], at: float) -> None:
        self.num_runs += 1
        self.num_buckets = num_buckets
        self.drifts = drifts
        self.last_success_at = at

    def collect(self) -> Iterator[Metric]:
        """The counts as Prometheus families (a prometheus_client collector)."""
        yield CounterMetricFamily(
            "tokenbus_budget_reconcile_runs", "reconciliations run", value=self.num_runs
        )
        yield CounterMetricFamily(
            "tokenbus_budget_reconcile_failures",
            "reconciliations that failed (tried again next interval)",
            value=self.num_failures,
        )
        yield GaugeMetricFamily(
            "tokenbus_budget_reconcile_last_success_timestamp_seconds",
            "when the last reconciliation succeeded (unix seconds)",
            value=self.last_success_at,
        )
        yield GaugeMetricFamily(
            "tokenbus_budget_reconcile_buckets", "buckets compared", value=self.num_buckets
        )
        yield GaugeMetricFamily(
            "tokenbus_budget_reconcile_drifting_buckets",
            "buckets whose spend drifts",
            value=len(self.drifts),
        )
        drift = GaugeMetricFamily(
            "tokenbus_budget_drift_units",
            "The job's settled spend less ClickHouse's.",
            labels=["budget_id", "bucket"],
        )
        for each in self.drifts:
            drift.add_metric([each.budget_id, each.bucket], float(each.drift_units))
        yield drift

    def render(self) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry).decode()


def reconcile_now(settings: Settings) -> tuple[int, list[Drift]]:
    """One run, blocking: the caller puts it on a thread."""
    reader = open_reader(settings, borrow_directory=False)
    try:
        return reconcile(
            lambda: job_budgets(settings)["buckets"],
            reader,
            settle_s=settings.budget_reconcile_settle_s,
        )
    finally:
        reader.close()


async def reconcile_forever(
    settings: Settings,
    metrics: ReconcileMetrics,
    stop: asyncio.Event,
    run_once: Callable[[Settings], tuple[int, list[Drift]]] = reconcile_now,
) -> None:
    interval_s = settings.budget_reconcile_interval_s
    while interval_s > 0:
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
            return
        except TimeoutError:
            pass
        try:
            num_buckets, drifts = await asyncio.to_thread(run_once, settings)
        except Exception as exc:
            metrics.num_failures += 1
            log.warning("budget reconciliation failed, again in %.0f s: %s", interval_s, exc)
            continue
        metrics.record(num_buckets, drifts, time.time())
        for drift in drifts:
            log.warning(
                "budget drift %s %s: job %s, ClickHouse %s (%s)",
                drift.budget_id,
                drift.bucket,
                drift.job_units,
                drift.billed_units,
                drift.drift_units,
            )
        total = sum((abs(d.drift_units) for d in drifts), Decimal(0))
        log.info(
            "reconciled %d budget buckets: %d drifting, %s units", num_buckets, len(drifts), total
        )
