"""The daily reconciliation, in the alerts service: drift --> log and ``/metrics``.

# every budget_reconcile_interval_s: job /budgets + ClickHouse --> alerts.reconcile
# --> a warning per drifting bucket, gauges for /metrics

Reads ClickHouse through the billing sink's query server (or a server DSN), never by
opening the sink's chdb directory (``open_reader(borrow_directory=False)``): a failed
run (job or sink not answering) is logged, counted, and tried again next interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from decimal import Decimal

from alerts.reconcile import Drift, reconcile
from billing.reader import open_reader
from tokenbus.budget_admin import job_budgets
from tokenbus.config import Settings

log = logging.getLogger(__name__)


class ReconcileMetrics:
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

    def render(self) -> str:
        lines = [
            "# TYPE tokenbus_budget_reconcile_runs_total counter",
            f"tokenbus_budget_reconcile_runs_total {self.num_runs}",
            "# TYPE tokenbus_budget_reconcile_failures_total counter",
            f"tokenbus_budget_reconcile_failures_total {self.num_failures}",
            "# TYPE tokenbus_budget_reconcile_last_success_timestamp_seconds gauge",
            f"tokenbus_budget_reconcile_last_success_timestamp_seconds {self.last_success_at}",
            "# TYPE tokenbus_budget_reconcile_buckets gauge",
            f"tokenbus_budget_reconcile_buckets {self.num_buckets}",
            "# TYPE tokenbus_budget_reconcile_drifting_buckets gauge",
            f"tokenbus_budget_reconcile_drifting_buckets {len(self.drifts)}",
            "# HELP tokenbus_budget_drift_units The job's settled spend less ClickHouse's.",
            "# TYPE tokenbus_budget_drift_units gauge",
        ]
        for drift in self.drifts:
            labels = f'budget_id="{_label(drift.budget_id)}",bucket="{_label(drift.bucket)}"'
            lines.append(f"tokenbus_budget_drift_units{{{labels}}} {drift.drift_units}")
        return "\n".join(lines) + "\n"


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


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
