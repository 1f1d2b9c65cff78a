"""The live view (billing.live, billing.html.render_live): the job's metrics and the
usage rows' TTFT, joined by model; the slowest requests of the window, linked to their
traces."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import generate_latest

from batches.metrics import RunnerMetrics
from billing.dedup import write_usage
from billing.html import render_live, trace_href
from billing.live import (
    LIVE_SLOWEST,
    LIVE_TTFT,
    SLOWEST_MAX_LIMIT,
    SlowRequest,
    live_view,
    slowest_params,
)
from billing.queries import QueryParamError
from billing.storage import ClickHouseStore
from schemas import UsageEvent, UsageStatus, WorkerStatus
from stream_jobs.dispatcher import DispatchMetrics
from stream_jobs.metrics import job_registry
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer

NOW = datetime(2026, 3, 2, 12, tzinfo=UTC)
PRICER = Pricer(read_price_book(BUNDLED_PRICES))
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


def test_the_slowest_query_takes_the_window_a_tenant_and_a_limit() -> None:
    sql, values = LIVE_SLOWEST.to_sql({})
    assert values == {"window_s": "300", "tenant": "", "limit": "10"}
    assert values["window_s"] == LIVE_TTFT.to_sql({})[1]["window_s"]
    where = sql[sql.index("WHERE") :]
    assert where.index("tenant_id") < where.index("created_at")  # tenant first
    assert "GROUP BY tenant_id, request_id" in sql
    assert "ORDER BY first_token_ms DESC, tenant_id, request_id" in sql
    assert "LIMIT {limit:UInt32}" in sql


def test_the_url_chooses_the_tenant_and_a_capped_limit() -> None:
    assert slowest_params({}, "300") == {"window_s": "300", "tenant": "", "limit": "10"}
    assert slowest_params({"tenant": "acme", "limit": "3"}, "60") == {
        "window_s": "60",
        "tenant": "acme",
        "limit": "3",
    }
    assert slowest_params({"limit": "100000"}, "300")["limit"] == str(SLOWEST_MAX_LIMIT)
    assert slowest_params({"limit": ""}, "300")["limit"] == "10"


@pytest.mark.parametrize(
    "query",
    [
        {"limit": "0"},
        {"limit": "-1"},
        {"limit": "ten"},
        {"limit": "1.5"},
        {"limit": "\u0661"},  # a digit, but not an ASCII one
        {"tenant": "<script>"},
        {"tenant": "acme\n"},
        {"tenant": "a" * 129},
    ],
)
def test_a_malformed_parameter_is_refused_with_the_reason(query: dict[str, str]) -> None:
    with pytest.raises(QueryParamError, match=r"^(limit|tenant) must be") as refused:
        slowest_params(query, "300")
    assert "<" not in str(refused.value)  # the reason does not echo the value


def _attempt(
    tenant: str,
    request_id: str,
    ttft_ms: float | None,
    *,
    attempt: int = 0,
    total_ms: float = 500.0,
    status: UsageStatus = UsageStatus.OK,
    age: timedelta = timedelta(seconds=10),
) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        session_id="s",
        tenant_id=tenant,
        model="tiny",
        attempt=attempt,
        status=status,
        num_prompt_tokens=5,
        num_completion_tokens=7,
        ttft_ms=ttft_ms,
        total_ms=total_ms,
        created_at=datetime.now(UTC) - age,
    )


def test_the_slowest_requests_of_the_window_one_row_per_request() -> None:
    usage = [
        # Resumed: the first attempt's first token is the request's, the last one's end
        # its duration, and its status the last attempt's.
        _attempt("acme", "resumed", 40.0, status=UsageStatus.FAILED, total_ms=300.0),
        _attempt("acme", "resumed", 900.0, attempt=1, total_ms=1200.0),
        _attempt("acme", "slow", 300.0),
        _attempt("acme", "no_token", None, status=UsageStatus.FAILED, total_ms=9000.0),
        _attempt("globex", "other", 100.0),
        _attempt("acme", "long_ago", 5000.0, age=timedelta(minutes=10)),
    ]
    with ClickHouseStore("chdb://memory") as store:
        write_usage(store, usage, PRICER)

        def slowest(**query: str) -> list[SlowRequest]:
            sql, values = LIVE_SLOWEST.to_sql(slowest_params(query, "300"))
            return live_view("", [], slowest_rows=store.query(sql, values)).slowest

        everyone = slowest()
        only_acme = slowest(tenant="acme")
        top = slowest(limit="1")

    assert [(r.tenant, r.request_id, r.ttft_ms) for r in everyone] == [
        ("acme", "slow", 300.0),
        ("globex", "other", 100.0),
        ("acme", "resumed", 40.0),
    ]
    resumed = everyone[2]
    assert (resumed.duration_ms, resumed.num_attempts, resumed.status) == (1200.0, 2, "ok")
    assert (resumed.num_prompt_tokens, resumed.num_completion_tokens) == (10, 14)
    assert resumed.model == "tiny"
    assert [r.request_id for r in only_acme] == ["slow", "resumed"]
    assert [r.request_id for r in top] == ["slow"]


def test_the_slowest_table_links_each_request_to_its_trace_and_escapes_it() -> None:
    rows = [
        {
            "tenant_id": "acme",
            "request_id": "req-1",
            "model": "tiny",
            "first_token_ms": 812.25,
            "duration_ms": 1500.0,
            "num_prompt_tokens": 5,
            "num_completion_tokens": 7,
            "last_status": "ok",
            "num_attempts": 2,
        },
        {
            "tenant_id": 'a"><script>x</script>',
            "request_id": "r&<b>/../1?x=1#",
            "model": "<i>m</i>",
            "first_token_ms": 1.0,
            "duration_ms": 2.0,
            "num_prompt_tokens": 0,
            "num_completion_tokens": 1,
            "last_status": "failed",
            "num_attempts": 1,
        },
    ]
    view = live_view("", [], slowest_rows=rows, slowest_tenant="")
    page = render_live(view, generated_at=NOW)

    assert "Slowest recent requests" in page and "Of every tenant" in page
    assert (
        "<td>acme</td><td>req-1</td><td>tiny</td><td>812.2</td><td>1,500.0</td>"
        '<td>5 / 7</td><td>2</td><td>ok</td><td><a href="trace/req-1?tenant=acme">trace</a></td>'
    ) in page
    assert "<script>" not in page and "<i>" not in page and "<b>" not in page
    assert "<td>a&quot;&gt;&lt;script&gt;x&lt;/script&gt;</td>" in page
    assert (
        '<a href="trace/r%26%3Cb%3E%2F..%2F1%3Fx%3D1%23'
        '?tenant=a%22%3E%3Cscript%3Ex%3C%2Fscript%3E">trace</a>'
    ) in page
    assert trace_href("t", "a b") == "trace/a%20b?tenant=t"
    filtered = render_live(live_view("", [], slowest_tenant="acme"), generated_at=NOW)
    assert "Of tenant acme" in filtered and "<p>no request</p>" in filtered
