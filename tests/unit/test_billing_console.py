from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.console import Console

from billing.console import billing_query, billing_report, list_queries
from billing.dedup import write_usage
from billing.storage import ClickHouseStore
from schemas import UsageEvent, UsageStatus
from tokenbus.config import Settings
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer

PRICER = Pricer(read_price_book(BUNDLED_PRICES))


@pytest.fixture
def writer() -> Iterator[ClickHouseStore]:
    with ClickHouseStore("chdb://memory") as store:
        yield store


def _event(tenant: str, n: int) -> UsageEvent:
    return UsageEvent(
        request_id=f"req_{tenant}_{n}",
        session_id=f"sess_{tenant}",
        tenant_id=tenant,
        model="tiny",
        status=UsageStatus.OK,
        num_prompt_tokens=1000,
        num_completion_tokens=n,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def test_prints_a_table_per_tenant_and_per_session(writer: ClickHouseStore, tmp_path: Path) -> None:
    write_usage(writer, [_event("acme", n) for n in range(3)] + [_event("beta", 5)], PRICER)
    console = Console(record=True, width=160)

    billing_report(Settings(home=tmp_path, clickhouse_dsn="chdb://memory"), console, tenant="acme")

    text = console.export_text()
    assert "Usage per tenant" in text
    assert "Usage per session" in text
    assert "sess_acme" in text
    assert "3,000" in text  # acme's prompt tokens, counted once each
    assert "beta" not in text


def test_an_unreadable_store_exits_with_status_1(tmp_path: Path) -> None:
    console = Console(record=True, width=160)
    settings = Settings(home=tmp_path, clickhouse_dsn="http://127.0.0.1:9/")

    with pytest.raises(SystemExit) as exc_info:
        billing_report(settings, console)

    assert exc_info.value.code == 1
    assert "cannot read billing data" in console.export_text()


def test_a_dashboard_query_prints_its_rows(writer: ClickHouseStore, tmp_path: Path) -> None:
    write_usage(writer, [_event("acme", n) for n in range(3)] + [_event("beta", 5)], PRICER)
    console = Console(record=True, width=200)
    settings = Settings(home=tmp_path, clickhouse_dsn="chdb://memory")

    billing_query(settings, console, "spend_by_tenant_per_day", {"tenant": "acme"})

    text = console.export_text()
    assert "Spend by tenant per day" in text
    assert "2026-01-01" in text
    assert "3,000" in text  # acme's prompt tokens
    assert "beta" not in text
    assert "tenant='acme'" in text


def test_a_query_with_no_rows_says_so(writer: ClickHouseStore, tmp_path: Path) -> None:
    console = Console(record=True, width=200)

    billing_query(
        Settings(home=tmp_path, clickhouse_dsn="chdb://memory"),
        console,
        "top_sessions_by_cost",
        {},
    )

    assert "Top sessions by cost: no rows" in console.export_text()


def test_an_unknown_query_or_parameter_exits_with_status_1(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, clickhouse_dsn="chdb://memory")
    for name, params in (("no_such_query", {}), ("spend_by_tenant_per_day", {"colour": "x"})):
        console = Console(record=True, width=200)
        with pytest.raises(SystemExit) as exc_info:
            billing_query(settings, console, name, params)
        assert exc_info.value.code == 1
        assert "error:" in console.export_text()


def test_the_list_names_every_query() -> None:
    console = Console(record=True, width=250)

    list_queries(console)

    text = console.export_text()
    assert "spend_by_tenant_per_day" in text
    assert "ttft_by_tenant_and_priority" in text
    assert "bucket_tokens='2048'" in text
