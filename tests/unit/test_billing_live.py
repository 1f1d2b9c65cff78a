"""The live view (billing.live, billing.html.render_live): the job's metrics and the
usage rows' TTFT, joined by model."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import generate_latest

from batches.metrics import RunnerMetrics
from billing.html import render_live
from billing.live import LIVE_TTFT, live_view
from schemas import WorkerStatus
from stream_jobs.dispatcher import DispatchMetrics
from stream_jobs.metrics import job_registry

NOW = datetime(2026, 3, 2, 12, tzinfo=UTC)
_BATCH = {
    "id": "batch_01JABCDEFGH",
    "endpoint": "/v1/chat/completions",
    "input_file_id": "file-01JABCDEFGH",
    "completion_window": "24h",
    "status": "in_progress",
    "created_at": 1_700_000_000,
    "tenant": "acme",
}


def _job_text() -> str:
    metrics = DispatchMetrics()
    for n, kv in ((0, 0.25), (1, 0.5)):
        metrics.workers[f"w{n}"] = WorkerStatus(
            worker_id=f"w{n}",
            model="tiny",
            request_topic=f"tokenbus.worker.w{n}",
            num_running=3,
            num_waiting=1,
            kv_cache_usage=kv,
            tokens_per_s=100.0,
            max_num_seqs=64,
        )
    registry = job_registry(lambda: metrics, waiting=lambda: {("tiny", 1): 4})
    return generate_latest(registry).decode()


def test_models_and_workers_from_the_job_and_ttft_from_the_rows() -> None:
    rows = [{"model": "tiny", "num_attempts": 9, "p50_ttft_ms": 12.5, "p99_ttft_ms": 80.0}]
    view = live_view(_job_text(), rows)

    [tiny] = view.models
    assert (tiny.model, tiny.num_queued, tiny.num_waiting, tiny.num_running) == ("tiny", 4, 6, 6)
    assert (tiny.num_workers, tiny.tokens_per_s) == (2, 200.0)
    assert (tiny.p50_ttft_ms, tiny.p99_ttft_ms, tiny.num_attempts) == (12.5, 80.0, 9)
    assert tiny.num_recommended == 1
    assert [(w.worker, w.kv_cache_usage) for w in view.workers] == [("w0", 0.25), ("w1", 0.5)]

    page = render_live(view, generated_at=NOW)
    assert "<td>tiny</td><td>4</td><td>6</td><td>6</td><td>12.5</td><td>80.0</td>" in page
    assert "<td>w1</td><td>tiny</td><td>3</td><td>1</td><td>50.0%</td>" in page
    assert 'http-equiv="refresh"' in page


def test_a_source_that_failed_is_named_and_the_rest_still_shows() -> None:
    view = live_view("", [{"model": "m", "num_attempts": 1, "p50_ttft_ms": 1, "p99_ttft_ms": 2}])
    page = render_live(view, generated_at=NOW, errors={"job": "http://x/metrics: refused <b>"})

    assert 'class="error">job: http://x/metrics: refused &lt;b&gt;' in page
    assert "<td>m</td>" in page
    assert "no worker live" in page


def test_the_ttft_query_takes_a_window() -> None:
    sql, values = LIVE_TTFT.to_sql({})
    assert values == {"window_s": "300"}
    assert "{window_s:UInt32}" in sql and "GROUP BY model" in sql


def test_running_batches_from_the_runner_s_metrics() -> None:
    from schemas.batches import BatchDoc

    runner = RunnerMetrics()
    doc = BatchDoc.model_validate(
        {
            **_BATCH,
            "request_counts": {"total": 10, "completed": 6, "failed": 1},
            "usage": {"input_tokens": 60, "output_tokens": 24},
            "in_flight": 2,
            "eta_s": 12.4,
        }
    )
    runner.observe(doc, num_left=3)
    view = live_view("", [], runner.render().decode())
    [batch] = view.batches
    assert (batch.tenant, batch.batch) == ("acme", "batch_01JABCDEFGH")
    assert (batch.num_completed, batch.num_failed, batch.num_remaining) == (6, 1, 3)
    assert (batch.num_in_flight, batch.prompt_tokens, batch.completion_tokens) == (2, 60, 24)
    assert batch.eta_s == 12.4
    page = render_live(view, generated_at=NOW)
    assert "<td>acme</td><td>batch_01JABCDEFGH</td><td>6</td><td>1</td><td>3</td><td>2</td>" in page
    assert "<td>60 / 24</td><td>12</td>" in page
    runner.forget("acme", "batch_01JABCDEFGH")
    assert live_view("", [], runner.render().decode()).batches == []
    assert "no batch running" in render_live(live_view("", []), generated_at=NOW)
