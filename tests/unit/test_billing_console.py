from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.console import Console

from billing.console import billing_report
from billing.storage import ClickHouseStore
from schemas import UsageEvent, UsageStatus
from tokenbus.config import Settings


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
    writer.insert_usage([_event("acme", n) for n in range(3)] + [_event("beta", 5)])
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
