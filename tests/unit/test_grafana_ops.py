"""The operations dashboard (billing.grafana_ops): checked in up to date, and every
metric its panels query is one a tokenbus service exports."""

from __future__ import annotations

import json
import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.fake_engine import FakeEngine
from billing.grafana_ops import operations_dashboard, render
from billing.metrics import billing_registry
from billing.queries import DASHBOARDS_DIR
from bridge.metrics import BridgeMetrics
from schemas import WorkerStatus
from stream_jobs.dispatcher import DispatchMetrics
from stream_jobs.metrics import job_registry
from tokenbus.metrics import PartitionOffsets, TenantLabels
from workers.metrics import WorkerMetrics

_NAME = re.compile(r"\b(tokenbus_[a-z0-9_]+)")


def _names(registry: CollectorRegistry) -> set[str]:
    return {
        sample.name
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def exported() -> set[str]:
    """Every sample name the services' registries write, with one of everything in them."""
    bridge = BridgeMetrics()
    labels = bridge.labels("acme", "tiny", 1)
    bridge.completions.labels(*labels, "ok").inc()
    bridge.ttft.labels(*labels).observe(0.1)
    bridge.itl.labels(*labels).observe(0.01)
    bridge.tokens_relayed.labels("acme").inc()
    bridge.requests.labels("/v1/completions", "200").inc()
    worker = WorkerMetrics("w1", FakeEngine("tiny", 4), TenantLabels(2), lambda: None, "t")
    worker.request_done("acme", "tiny", 1, "stop", 3, 0.1, 0.01)
    metrics = DispatchMetrics()
    metrics.queue_ms_by_class[0] = [1.0]
    metrics.workers["w1"] = WorkerStatus(worker_id="w1", model="tiny", request_topic="t")
    job = job_registry(
        lambda: metrics,
        waiting=lambda: {("tiny", 0): 1},
        lag=lambda: [PartitionOffsets("r", 0, 2, 1)],
    )

    class Sink:
        newest_created_at: float | None = 1.0

        def stats(self) -> dict[str, int]:
            return {}

    billing = billing_registry(Sink(), list)
    return set().union(*(_names(r) for r in (bridge.registry, worker.registry, job, billing)))


def test_the_checked_in_json_is_the_generated_one() -> None:
    checked_in = (DASHBOARDS_DIR / "operations.json").read_text()
    assert checked_in == render(), (
        "run: python -m billing.grafana_ops > billing/dashboards/operations.json"
    )


def test_every_panel_queries_metrics_the_services_export() -> None:
    names = exported()
    dashboard = operations_dashboard()
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in _NAME.findall(target["expr"])
    }
    assert queried, "no panel queries anything"
    assert queried <= names, sorted(queried - names)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["type"] == "prometheus"
        assert panel["targets"]
    json.dumps(dashboard)
