"""The loopback query server, on the embedded engine with a read-only client."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from clickhouse_connect.driver.exceptions import DatabaseError

from billing.alert_sink import write_alerts
from billing.dedup import write_usage
from billing.metrics import billing_registry
from billing.query_server import create_app, dashboard_filters
from billing.storage import ClickHouseStore, Row
from billing.traces import TRACE_SQL, span_rows
from schemas import UsageEvent, UsageStatus
from schemas.budgets import BudgetAlert
from tests.unit.test_traces import traced_request
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer

PRICER = Pricer(read_price_book(BUNDLED_PRICES))


def budget_alert(tenant: str, threshold: int) -> BudgetAlert:
    return BudgetAlert(
        alert_id=f"tenant:{tenant}|month@UTC|2026-01-01|{threshold}",
        budget_id=f"tenant:{tenant}|month@UTC",
        entity=f"tenant:{tenant}",
        tenant_id=tenant,
        period_start=datetime(2026, 1, 1, tzinfo=UTC),
        period_end=datetime(2026, 2, 1, tzinfo=UTC),
        threshold=threshold,
        limit_units="1",
        spent_units="0.8",
        enforce="hard",
        fired_at=datetime(2026, 1, 1, 10, 30, tzinfo=UTC),
    )


@pytest.fixture
def stores() -> Iterator[tuple[ClickHouseStore, ClickHouseStore]]:
    """(writer, read-only reader) on one embedded engine, as in the sink's process."""
    with ClickHouseStore("chdb://memory") as writer:
        with ClickHouseStore("chdb://memory", migrate=False, read_only=True) as reader:
            yield writer, reader


@pytest.fixture
async def client(
    stores: tuple[ClickHouseStore, ClickHouseStore], tmp_path: Path
) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(stores[1], dsn=f"chdb://{tmp_path}", stats=lambda: {"num_inserted": 7})
    async with TestClient(TestServer(app)) as client:
        yield client


async def _post(client: TestClient[Any, Any], body: Any) -> tuple[int, Any]:
    response = await client.post("/query", data=orjson.dumps(body))
    return response.status, orjson.loads(await response.read())


async def test_select_returns_rows_as_json(
    client: TestClient[Any, Any], stores: tuple[ClickHouseStore, ClickHouseStore]
) -> None:
    write_usage(
        stores[0],
        [
            UsageEvent(
                request_id="req_1",
                session_id="sess_1",
                tenant_id="acme",
                model="tiny",
                status=UsageStatus.OK,
                num_prompt_tokens=11,
                created_at=datetime(2026, 1, 1, tzinfo=UTC),
            )
        ],
        PRICER,
    )

    status, body = await _post(
        client,
        {
            "sql": "SELECT tenant_id, prompt_tokens, created_at, ttft_ms, toDecimal64(1.25, 2) AS d"
            " FROM usage_events FINAL WHERE tenant_id = {tenant:String}",
            "parameters": {"tenant": "acme"},
        },
    )

    assert status == 200
    assert body == {
        "rows": [
            {
                "tenant_id": "acme",
                "prompt_tokens": 11,
                "created_at": "2026-01-01T00:00:00+00:00",
                "ttft_ms": None,
                "d": str(Decimal("1.25")),
            }
        ]
    }


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("INSERT INTO usage_events (tenant_id) VALUES ('x')", "read-only statements"),
        ("SELECT 1; DROP TABLE usage_events", "one statement"),
        ("SELEC 1", "only read-only statements"),
        ("SELECT 1 INTO OUTFILE 'billing-test-outfile.txt'", "INTO OUTFILE"),
        ("SELECT * FROM no_such_table", "UNKNOWN_TABLE"),
        ("SELECT nope FROM usage_events", "UNKNOWN_IDENTIFIER"),
    ],
)
async def test_refused_or_failing_sql_is_a_400_with_the_reason(
    client: TestClient[Any, Any], sql: str, message: str
) -> None:
    status, body = await _post(client, {"sql": sql})

    assert status == 400
    assert message in body["error"]
    # The table is intact and the handle answers the next query correctly.
    status, body = await _post(client, {"sql": "SELECT count() AS n FROM usage_events"})
    assert (status, body) == (200, {"rows": [{"n": 0}]})


@pytest.mark.parametrize(
    "sql",
    [
        "WITH 'x' AS t INSERT INTO usage_events (tenant_id) SELECT t",
        "SELECT * FROM system.one SETTINGS readonly = 0",
        "SELECT * FROM file('/etc/hostname', 'LineAsString')",
    ],
)
async def test_the_read_only_client_refuses_what_passes_the_keyword_check(
    client: TestClient[Any, Any], sql: str
) -> None:
    status, body = await _post(client, {"sql": sql})

    assert status == 400
    assert "readonly" in body["error"].lower()


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[]", b'{"sql": 1}', b'{"sql": "SELECT 1", "parameters": [1]}'],
)
async def test_malformed_requests_are_a_400(client: TestClient[Any, Any], raw: bytes) -> None:
    response = await client.post("/query", data=raw)

    assert response.status == 400
    assert "error" in orjson.loads(await response.read())


@pytest.fixture
def resolved_tmp_path(tmp_path: Path) -> str:
    return str(tmp_path.resolve())


async def test_healthz_names_the_directory_it_owns_and_the_counters(
    client: TestClient[Any, Any], resolved_tmp_path: str
) -> None:
    response = await client.get("/healthz")

    assert response.status == 200
    assert orjson.loads(await response.read()) == {
        "status": "ok",
        "chdb_path": resolved_tmp_path,
        "num_inserted": 7,
    }


async def test_the_dashboard_page_shows_every_query_for_the_window(
    client: TestClient[Any, Any], stores: tuple[ClickHouseStore, ClickHouseStore]
) -> None:
    events = [
        UsageEvent(
            request_id=f"req_{n}",
            session_id="sess_<b>",  # data is escaped, never markup
            tenant_id=tenant,
            model="tiny",
            status=UsageStatus.FAILED if n == 0 else UsageStatus.OK,
            num_prompt_tokens=3000 * (n + 1),
            num_completion_tokens=10,
            ttft_ms=20.0 + n,
            created_at=datetime(2026, 1, 1, 10, n, tzinfo=UTC),
        )
        for n, tenant in enumerate(["acme", "acme", "beta"])
    ]
    write_usage(stores[0], events, PRICER)
    write_alerts(stores[0], [budget_alert("acme", 80)])

    response = await client.get(
        "/dashboard", params={"since": "2026-01-01 00:00:00", "until": "2026-01-02 00:00:00"}
    )
    page = await response.text()

    assert response.status == 200
    assert response.content_type == "text/html"
    for title in (
        "Spend by tenant per day",
        "Tokens per minute by tenant",
        "Top sessions by cost",
        "Share of failed and cancelled work",
        "Cost per 1k tokens by context length",
        "p50 and p99 TTFT by tenant and priority",
        "Recent budget alerts",
    ):
        assert title in page
    assert "<td>tenant:acme|month@UTC</td><td>80%</td>" in page
    assert page.count("<svg") >= 6
    assert "sess_&lt;b&gt;" in page and "sess_<b>" not in page
    assert 'class="error"' not in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no CDN
    # A window without data renders empty charts, not errors.
    empty = await (await client.get("/dashboard", params={"since": "2030-01-01"})).text()
    assert "no data in this window" in empty


async def test_a_bad_dashboard_parameter_shows_as_an_error_on_the_page(
    client: TestClient[Any, Any],
) -> None:
    response = await client.get("/dashboard", params={"since": "not a time"})

    assert response.status == 200
    assert 'class="error"' in await response.text()


def test_the_dashboard_window_defaults_to_the_last_day() -> None:
    now = datetime(2026, 3, 2, 10, 30, 15, tzinfo=UTC)

    assert dashboard_filters({}, now) == {
        "tenant": "",
        "since": "2026-03-01 10:30:00",
        "until": "2026-03-02 10:31:00",
    }
    assert dashboard_filters({"tenant": "acme", "other": "x"}, now)["tenant"] == "acme"


async def test_metrics_and_the_live_view(
    stores: tuple[ClickHouseStore, ClickHouseStore], tmp_path: Path
) -> None:
    class Sink:
        newest_created_at: float | None = None

        def stats(self) -> dict[str, int]:
            return {"num_inserted": 3}

    registry = billing_registry(Sink(), list)
    now = datetime.now(UTC)
    write_usage(
        stores[0],
        [
            UsageEvent(
                request_id=f"live_{n}",
                session_id="s",
                tenant_id="acme",
                model="tiny",
                status=UsageStatus.OK,
                num_prompt_tokens=3,
                num_completion_tokens=10,
                ttft_ms=10.0 * (n + 1),
                created_at=now,
            )
            for n in range(3)
        ],
        PRICER,
    )
    app = create_app(
        stores[1],
        dsn=f"chdb://{tmp_path}",
        registry=registry,
        job_metrics_url="http://127.0.0.1:9/metrics",  # nothing listens: named on the page
    )
    async with TestClient(TestServer(app)) as client:
        metrics = await client.get("/metrics")
        text = await metrics.text()
        live = await client.get("/live")
        page = await live.text()

    assert metrics.status == 200
    assert "tokenbus_billing_rows_inserted_total 3.0" in text
    assert live.status == 200
    assert 'class="error">job: http://127.0.0.1:9/metrics' in page
    assert "<td>tiny</td><td>0</td><td>0</td><td>0</td><td>20.0</td>" in page


async def test_the_live_view_lists_the_slowest_requests_and_refuses_a_bad_limit(
    stores: tuple[ClickHouseStore, ClickHouseStore], client: TestClient[Any, Any]
) -> None:
    now = datetime.now(UTC)
    write_usage(
        stores[0],
        [
            UsageEvent(
                request_id=f"slow_{n}",
                session_id="s",
                tenant_id=tenant,
                model="tiny",
                status=UsageStatus.OK,
                num_prompt_tokens=3,
                num_completion_tokens=10,
                ttft_ms=100.0 * (n + 1),
                total_ms=1000.0,
                created_at=now,
            )
            for n, tenant in enumerate(("acme", "acme", "globex"))
        ],
        PRICER,
    )
    live = await client.get("/live", params={"tenant": "acme", "limit": "1"})
    page = await live.text()
    everyone = await (await client.get("/live")).text()
    bad = await client.get("/live", params={"limit": "many"})
    hostile = await client.get("/live", params={"tenant": "<script>"})

    assert live.status == 200
    assert "<td>acme</td><td>slow_1</td><td>tiny</td><td>200.0</td>" in page
    assert '<a href="trace/slow_1?tenant=acme">trace</a>' in page
    assert "slow_0" not in page and "slow_2" not in page
    assert everyone.index("slow_2") < everyone.index("slow_1") < everyone.index("slow_0")
    assert bad.status == 400 and "limit must be a whole number" in await bad.text()
    assert hostile.status == 400 and "<script>" not in await hostile.text()


async def test_a_trace_page_shows_the_request_s_spans(
    stores: tuple[ClickHouseStore, ClickHouseStore], client: TestClient[Any, Any]
) -> None:
    batches = await asyncio.to_thread(traced_request, "acme", "r1")  # it runs a loop of its own
    rows = [row for batch in batches for row in span_rows(batch)]
    stores[0].insert_spans(rows)

    response = await client.get("/trace/r1", params={"tenant": "acme"})
    page = await response.text()

    assert response.status == 200 and response.content_type == "text/html"
    assert "<h1>request r1 of tenant acme</h1>" in page
    for name in ("client.request", "job.admit", "worker.generate"):
        assert name in page
    assert "<code>attempt=0</code>" in page and "<code>attempt=1</code>" in page
    other = await client.get("/trace/r1", params={"tenant": "globex"})
    assert other.status == 404  # another tenant reads none of it


class RecordingStore:
    """A Queryable that records what it was asked, and answers ``rows`` or fails."""

    def __init__(self, rows: list[Row] | None = None, fail: bool = False) -> None:
        self.rows = rows or []
        self.fail = fail
        self.asked: list[tuple[str, Any]] = []

    def query(self, sql: str, parameters: Any = None) -> list[Row]:
        self.asked.append((sql, parameters))
        if self.fail:
            raise DatabaseError("Code: 60. Unknown table spans <b>")
        return self.rows


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/trace/r1", "the tenant is required"),
        ("/trace/r1?tenant=%3Cb%3E", "the tenant must be"),
        ("/trace/%3Cscript%3Ealert(1)%3C%2Fscript%3E?tenant=acme", "the request id must be"),
        ("/trace/r1%0A?tenant=acme", "the request id must be"),
        ("/trace/" + "r" * 129 + "?tenant=acme", "the request id must be"),
    ],
)
async def test_an_id_or_tenant_of_the_wrong_shape_is_a_400_that_never_queries(
    tmp_path: Path, path: str, reason: str
) -> None:
    store = RecordingStore()
    async with TestClient(TestServer(create_app(store, dsn=f"chdb://{tmp_path}"))) as client:
        response = await client.get(path)
        page = await response.text()

    assert response.status == 400, page
    assert reason in page
    assert "<script>" not in page and "<b>" not in page
    assert store.asked == []


async def test_no_spans_is_a_404_and_a_failing_store_a_500_each_saying_why(
    tmp_path: Path,
) -> None:
    empty, failing = RecordingStore(), RecordingStore(fail=True)
    responses = []
    for store in (empty, failing):
        app = create_app(store, dsn=f"chdb://{tmp_path}")
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/trace/r.1:x-y_z", params={"tenant": "acme"})
            responses.append((response.status, await response.text()))

    assert empty.asked == [(TRACE_SQL, {"tenant": "acme", "request_id": "r.1:x-y_z"})]
    (missing, missing_page), (failed, failed_page) = responses
    assert missing == 404
    assert "no spans of request r.1:x-y_z for tenant acme" in missing_page
    assert failed == 500
    assert "the span store failed: Code: 60. Unknown table spans &lt;b&gt;" in failed_page
