"""The job's /metrics (stream_jobs.metrics): prometheus_client's text, from the
dispatcher's plain counts, read back with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from schemas import WorkerStatus
from stream_jobs.dispatcher import DispatchMetrics
from stream_jobs.metrics import job_registry


def render_metrics(
    metrics: DispatchMetrics, budget_rows: list[dict[str, object]] | None = None
) -> bytes:
    """What the job's /metrics serves for these counts and budget rows."""
    return generate_latest(job_registry(lambda: metrics, lambda: budget_rows or []))


def samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_counts_gauges_and_summaries_render_with_their_types() -> None:
    metrics = DispatchMetrics(num_admitted=7, num_unauthenticated=2, num_forbidden=1, tier=1)
    metrics.queue_ms_by_class[0] = [1.0, 2.0, 30.0]
    text = render_metrics(metrics)
    got = samples(text)
    assert got[("tokenbus_job_num_admitted_total", frozenset())] == 7
    assert got[("tokenbus_job_num_unauthenticated_total", frozenset())] == 2
    assert got[("tokenbus_job_num_forbidden_total", frozenset())] == 1
    assert got[("tokenbus_job_tier", frozenset())] == 1
    p99 = frozenset({("priority", "0"), ("quantile", "0.99")})
    assert got[("tokenbus_job_queue_ms", p99)] == 30.0
    assert b"# TYPE tokenbus_job_queue_ms summary" in text


def test_each_worker_and_the_adapters_it_holds() -> None:
    metrics = DispatchMetrics()
    metrics.workers["w1"] = WorkerStatus(
        worker_id="w1",
        model="tiny",
        request_topic="tokenbus.worker.w1",
        num_running=3,
        kv_cache_usage=0.25,
        max_loras=2,
        adapters=["a1"],
        num_adapter_loads=4,
    )
    got = samples(render_metrics(metrics))
    worker = frozenset({("worker_id", "w1"), ("model", "tiny")})
    assert got[("tokenbus_job_worker_num_running", worker)] == 3
    assert got[("tokenbus_job_worker_kv_cache_usage", worker)] == 0.25
    assert got[("tokenbus_job_worker_adapter_loads_total", worker)] == 4
    assert got[("tokenbus_job_worker_adapter_held", worker | {("adapter", "a1")})] == 1


def test_budgets_show_their_spend_and_what_is_left() -> None:
    row: dict[str, object] = {
        "budget_id": "tenant:acme|month@UTC",
        "entity": "tenant:acme",
        "enforce": "hard",
        "period": "month",
        "limit": "10.5",
        "spent": "4",
        "reserved": "0.5",
        "remaining": "6",
    }
    got = samples(render_metrics(DispatchMetrics(), [row]))
    labels = frozenset(
        {
            ("budget", "tenant:acme|month@UTC"),
            ("entity", "tenant:acme"),
            ("enforce", "hard"),
            ("period", "month"),
        }
    )
    assert got[("tokenbus_job_budget_remaining_units", labels)] == 6.0
    assert got[("tokenbus_job_budget_limit_units", labels)] == 10.5
