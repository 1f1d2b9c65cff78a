"""The alerts service's scheduled reconciliation: runs each interval, exports drift."""

import asyncio
from decimal import Decimal

from prometheus_client.parser import text_string_to_metric_families

from billing.alerts.reconcile import Drift
from billing.alerts.reconciler import ReconcileMetrics, reconcile_forever
from tokenbus.config import Settings


async def test_each_interval_reconciles_and_the_metrics_show_the_drift() -> None:
    settings = Settings(budget_reconcile_interval_s=0.01)
    metrics = ReconcileMetrics()
    stop = asyncio.Event()
    runs: list[int] = []

    def run_once(_: Settings) -> tuple[int, list[Drift]]:
        runs.append(1)
        if len(runs) == 1:
            raise OSError("the job is not up yet")  # counted, tried again
        if len(runs) == 3:
            stop.set()
        return 4, [Drift('key:"x"|total', "total", Decimal("1.5"), Decimal("1.25"))]

    await asyncio.wait_for(reconcile_forever(settings, metrics, stop, run_once), timeout=5)

    assert len(runs) == 3
    page = metrics.render()
    assert "tokenbus_budget_reconcile_failures_total 1" in page
    assert "tokenbus_budget_reconcile_runs_total 2" in page
    assert "tokenbus_budget_reconcile_drifting_buckets 1" in page
    # prometheus_client writes the text (labels in its own order): read it back with its parser
    drifts = {
        (sample.labels["budget_id"], sample.labels["bucket"]): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "tokenbus_budget_drift_units"
    }
    assert drifts == {('key:"x"|total', "total"): 0.25}


async def test_an_interval_of_zero_never_runs() -> None:
    settings = Settings(budget_reconcile_interval_s=0)
    await asyncio.wait_for(
        reconcile_forever(settings, ReconcileMetrics(), asyncio.Event(), lambda s: (0, [])), 1
    )
