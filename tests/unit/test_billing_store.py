"""ClickHouseStore on the embedded engine (``chdb://memory``).

chdb hosts one engine per process, so every test closes what it opens: another test
module (and the integration test) may need the engine on a different path.
"""

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import clickhouse_connect
import pytest

from billing.migrate import Migration, apply_migrations, bundled_migrations
from billing.report import SessionTotals, TenantTotals, fetch
from billing.storage import ClickHouseStore, chdb_path
from schemas import UsageEvent, UsageStatus

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def store() -> Iterator[ClickHouseStore]:
    with ClickHouseStore("chdb://memory") as store:
        yield store


def _event(tenant: str, session: str, n: int, **overrides: object) -> UsageEvent:
    fields: dict[str, object] = {
        "request_id": f"req_{tenant}_{session}_{n}",
        "session_id": session,
        "tenant_id": tenant,
        "model": "tiny",
        "status": UsageStatus.OK,
        "num_prompt_tokens": 10 + n,
        "num_completion_tokens": 2 * n,
        "num_cached_tokens": n % 3,
        "created_at": T0 + timedelta(seconds=n),
        "finished_at": T0 + timedelta(seconds=n, milliseconds=250),
    }
    fields.update(overrides)
    return UsageEvent.model_validate(fields)


def test_migrations_apply_once_and_again_do_nothing() -> None:
    client = clickhouse_connect.get_client(dsn="chdb://memory")
    try:
        assert apply_migrations(client) == [m.version for m in bundled_migrations()]
        assert apply_migrations(client) == []
        # A store opening the same database migrates again without effect or error.
        ClickHouseStore("chdb://memory").close()

        ledger = client.query("SELECT version, name FROM schema_migrations").result_rows
        assert ledger == [(1, "usage_events")]
        assert client.query("EXISTS TABLE usage_events").result_rows == [(1,)]
    finally:
        client.close()


def test_migration_files_split_into_statements_without_comment_chunks() -> None:
    migration = Migration(
        7,
        "x",
        "-- intro\nCREATE TABLE a (x UInt8) ENGINE = Memory;\n"
        "-- between\nCREATE TABLE b (x UInt8) ENGINE = Memory;\n-- end\n",
    )

    assert [s.splitlines()[-1] for s in migration.statements] == [
        "CREATE TABLE a (x UInt8) ENGINE = Memory",
        "CREATE TABLE b (x UInt8) ENGINE = Memory",
    ]


def test_sort_key_is_tenant_first(store: ClickHouseStore) -> None:
    [table] = store.query(
        "SELECT sorting_key, engine FROM system.tables WHERE name = 'usage_events'"
    )

    assert table["sorting_key"] == "tenant_id, session_id, request_id, attempt"
    assert table["engine"] == "ReplacingMergeTree"


def test_rows_round_trip(store: ClickHouseStore) -> None:
    event = _event("acme", "sess_a", 1, worker_id="w0", ttft_ms=12.5, error_code=None)
    store.insert_usage([event])

    [row] = store.query("SELECT * FROM usage_events FINAL")

    assert row["tenant_id"] == "acme"
    assert row["worker_id"] == "w0"
    assert row["ttft_ms"] == 12.5
    assert row["error_code"] == ""
    assert row["created_at"] == event.created_at  # DateTime64(3,'UTC') back as aware UTC
    assert row["inserted_at"].tzinfo is not None


def test_redelivered_rows_do_not_double_the_totals(store: ClickHouseStore) -> None:
    events = [_event("acme", "sess_a", n) for n in range(5)] + [
        _event("beta", "sess_b", n, status=UsageStatus.FAILED) for n in range(3)
    ]
    store.insert_usage(events)
    store.insert_usage(events[:4])  # a redelivered batch, as after a crash before commit
    store.insert_usage(events[4:6])

    # The copies are really there (separate inserts, not merged yet) ...
    assert store.query("SELECT count() AS n FROM usage_events") == [{"n": 8 + 4 + 2}]
    # ... and the reports count each attempt once.
    totals = {row["tenant_id"]: row for row in fetch(store, TenantTotals())}
    assert list(totals) == ["acme", "beta"]
    acme = [e for e in events if e.tenant_id == "acme"]
    assert totals["acme"]["num_attempts"] == 5
    assert totals["acme"]["num_requests"] == 5
    assert totals["acme"]["num_failed"] == 0
    assert totals["acme"]["num_prompt_tokens"] == sum(e.num_prompt_tokens for e in acme)
    assert totals["acme"]["num_completion_tokens"] == sum(e.num_completion_tokens for e in acme)
    assert totals["acme"]["num_cached_tokens"] == sum(e.num_cached_tokens for e in acme)
    assert totals["beta"]["num_failed"] == 3

    [session] = fetch(store, SessionTotals(tenant_id="beta"))
    assert session["session_id"] == "sess_b"
    assert session["num_attempts"] == 3
    assert session["first_created_at"] == T0
    assert session["last_finished_at"] == T0 + timedelta(seconds=2, milliseconds=250)


def test_a_retried_attempt_is_its_own_row(store: ClickHouseStore) -> None:
    first = _event("acme", "sess_a", 1, status=UsageStatus.FAILED, worker_id="w0")
    retry = _event("acme", "sess_a", 1, attempt=1, worker_id="w1")
    store.insert_usage([first, retry])

    [totals] = fetch(store, TenantTotals(tenant_id="acme"))

    assert (totals["num_requests"], totals["num_attempts"], totals["num_failed"]) == (1, 2, 1)
    assert totals["num_prompt_tokens"] == 2 * first.num_prompt_tokens


def test_reports_filter_by_tenant_and_time(store: ClickHouseStore) -> None:
    store.insert_usage([_event("acme", "s", n) for n in range(10)] + [_event("beta", "s", 0)])

    rows = fetch(
        store,
        TenantTotals(
            tenant_id="acme", since=T0 + timedelta(seconds=2), until=T0 + timedelta(seconds=5)
        ),
    )

    assert [(r["tenant_id"], r["num_attempts"]) for r in rows] == [("acme", 3)]


def test_chdb_path_reads_only_directory_dsns() -> None:
    assert chdb_path("chdb:///var/lib/tb/clickhouse") == "/var/lib/tb/clickhouse"
    assert chdb_path("chdb://memory") is None
    assert chdb_path("chdb://memory/db") is None
    assert chdb_path("http://user:pw@host:8123/db") is None
