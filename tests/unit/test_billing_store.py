"""ClickHouseStore on the embedded engine (``chdb://memory``).

chdb hosts one engine per process, so every test closes what it opens: another test
module (and the integration test) may need the engine on a different path.
"""

import gc
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, cast

import clickhouse_connect
import orjson
import pytest
from clickhouse_connect.datatypes.registry import get_from_name
from clickhouse_connect.datatypes.temporal import DateTime64

from billing.dedup import (
    SUPERSEDED,
    Stored,
    dedup_token,
    plan_keyed_columns,
    usage_key,
    write_usage,
)
from billing.migrate import Migration, apply_migrations, bundled_migrations
from billing.queries import dashboard_query
from billing.report import BatchTotals, SessionTotals, TenantTotals, fetch
from billing.storage import (
    ClickHouseStore,
    PriceConflict,
    StoredAttempts,
    chdb_path,
)
from billing.traces import span_rows
from schemas import UsageEvent, UsageStatus, decode
from schemas.spans import SpanBatch
from tests.unit.usage_rows import insert_rows, ticks, usage_row
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Price, PriceBook, Pricer

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
PRICER = Pricer(read_price_book(BUNDLED_PRICES))
_ROLLUP_TOTALS = """\
SELECT sum(n) AS num_attempts, sum(p) AS prompt_tokens, sum(c) AS completion_tokens,
       sum(u) AS cost_units
FROM (SELECT count() AS n, sum(prompt_tokens) AS p, sum(completion_tokens) AS c,
             sum(cost_units) AS u
      FROM usage_events GROUP BY {keys})
SETTINGS force_optimize_projection = 1"""
MINUTE_ROLLUP = _ROLLUP_TOTALS.format(keys="tenant_id, model, toStartOfMinute(created_at), status")
"""Totals read from the tenant x model x minute rollup; it fails if a projection is not used."""
SESSION_ROLLUP = _ROLLUP_TOTALS.format(keys="tenant_id, session_id")


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

        ledger = client.query(
            "SELECT version, name FROM schema_migrations ORDER BY version"
        ).result_rows
        assert ledger == [
            (1, "usage_events"),
            (2, "cost_and_rollups"),
            (3, "adapter"),
            (4, "usage_key"),
            (5, "budget_alerts"),
            (6, "created_at_index"),
            (7, "batch_id"),
            (8, "spans"),
            (9, "compact_parts"),
        ]
        assert len(ledger) == len(bundled_migrations())
        for table in ("usage_events", "prices", "budget_alerts", "spans"):
            assert client.query(f"EXISTS TABLE {table}").result_rows == [(1,)]
    finally:
        client.close()


def test_an_insert_past_the_default_wide_size_is_written_compact_rollups_included(
    store: ClickHouseStore,
) -> None:
    # 60,000 rows of about 250 bytes: past ClickHouse's 10 MiB default for a wide part.
    store.query(
        "INSERT INTO usage_events (tenant_id, session_id, request_id, model, status,"
        " key_sha256, created_at, finished_at)"
        " SELECT 'acme', toString(number % 1000), toString(number), 'tiny', 'ok',"
        " repeat('k', 200), toDateTime64('2026-03-01 12:00:00', 3, 'UTC'),"
        " toDateTime64('2026-03-01 12:00:00', 3, 'UTC') FROM numbers(60000)"
    )
    [part] = store.query(
        "SELECT part_type, data_uncompressed_bytes FROM system.parts"
        " WHERE table = 'usage_events' AND active"
    )
    assert part["data_uncompressed_bytes"] > 10 << 20
    assert part["part_type"] == "Compact"
    projections = store.query(
        "SELECT name, part_type FROM system.projection_parts"
        " WHERE table = 'usage_events' AND active ORDER BY name"
    )
    assert [(p["name"], p["part_type"]) for p in projections] == [
        ("usage_by_minute", "Compact"),
        ("usage_by_session", "Compact"),
    ]


def test_version_2_collapses_version_1_copies_and_rolls_those_rows_up_once() -> None:
    client = clickhouse_connect.get_client(dsn="chdb://memory")
    try:
        first, second = bundled_migrations()[:2]
        apply_migrations(client, [first])
        # Version 1 rows, one of them delivered twice (version 1 relied on FINAL).
        for n in (0, 1, 2, 2):
            client.command(
                "INSERT INTO usage_events (tenant_id, session_id, request_id, model, status,"
                " prompt_tokens, created_at, finished_at) VALUES"
                f" ('acme', 's', 'r{n}', 'tiny', 'ok', {10 + n}, '2026-03-01 12:00:0{n}',"
                f" '2026-03-01 12:00:0{n}')"
            )
        apply_migrations(client, [first, second])
        # As if the process died before recording version 2: its statements run again.
        for statement in second.statements:
            client.command(statement)

        # Plain reads, answered by the rollups: the copy is gone.
        for rollup in (MINUTE_ROLLUP, SESSION_ROLLUP):
            [row] = client.query(rollup).named_results()
            assert (row["num_attempts"], row["prompt_tokens"]) == (3, 10 + 11 + 12)
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


def test_sort_keys_are_tenant_first(store: ClickHouseStore) -> None:
    [table] = store.query(
        "SELECT sorting_key, engine FROM system.tables WHERE name = 'usage_events'"
    )
    rollups = {
        row["name"]: row["sorting_key"]
        for row in store.query(
            "SELECT name, sorting_key FROM system.projections WHERE table = 'usage_events'"
        )
    }

    assert table["sorting_key"] == "tenant_id, session_id, request_id, attempt"
    assert table["engine"] == "ReplacingMergeTree"
    assert rollups == {
        "usage_by_minute": ["tenant_id", "model", "toStartOfMinute(created_at)", "status"],
        "usage_by_session": ["tenant_id", "session_id"],
    }


def test_the_table_remembers_block_tokens_and_syncs_its_parts(store: ClickHouseStore) -> None:
    [table] = store.query(
        "SELECT create_table_query AS ddl FROM system.tables WHERE name = 'usage_events'"
    )

    for setting in (
        "non_replicated_deduplication_window = 1000",
        "fsync_after_insert = 1",
        "deduplicate_merge_projection_mode = 'rebuild'",
    ):
        assert setting in table["ddl"]


def _rows(events: Sequence[UsageEvent]) -> list[tuple[Any, ...]]:
    return [usage_row(e, PRICER.charge(e)) for e in events]


def _totals(store: ClickHouseStore, rollup: str) -> dict[str, Any]:
    [row] = store.query(rollup)
    return {key: row[key] for key in ("num_attempts", "prompt_tokens", "completion_tokens")} | {
        "cost_units": row["cost_units"]
    }


def test_rows_round_trip(store: ClickHouseStore) -> None:
    event = _event(
        "acme",
        "sess_a",
        1,
        worker_id="w0",
        ttft_ms=12.5,
        error_code=None,
        precision="int8",
        flags=["injection_suspected"],
        overload_tier=1,
        key_sha256="ab" * 32,
    )
    write_usage(store, [event], PRICER)

    [row] = store.query("SELECT * FROM usage_events")

    assert row["tenant_id"] == "acme"
    assert row["worker_id"] == "w0"
    assert row["ttft_ms"] == 12.5
    assert row["error_code"] == ""
    assert row["created_at"] == event.created_at  # DateTime64(3,'UTC') back as aware UTC
    assert row["inserted_at"].tzinfo is not None
    assert (row["precision"], row["flags"], row["overload_tier"]) == (
        "int8",
        ["injection_suspected"],
        1,
    )
    charge = PRICER.charge(event)
    assert row["cost_units"] == charge.cost_units > 0  # Decimal, to the last digit
    assert row["billed_units"] == charge.billed_units
    assert (row["cost_weight"], row["price_version"]) == (0.7, 1)
    write_usage(store, [_event("acme", "sess_b", 2)], PRICER)
    keys = store.query("SELECT key_sha256 FROM usage_events ORDER BY session_id")
    assert [r["key_sha256"] for r in keys] == ["ab" * 32, ""]  # no key behind it: ''


def test_a_look_up_finds_exactly_the_stored_keys(store: ClickHouseStore) -> None:
    stored = [_event("acme", "s1", n) for n in range(3)] + [_event("beta", "s2", 0)]
    write_usage(store, stored, PRICER)
    # Same tenants, sessions and requests in other combinations are not stored keys.
    crossed = ("acme", "s2", stored[0].request_id, 0)
    other_attempt = (*usage_key(stored[1])[:3], 1)

    found = store.look_up([usage_key(stored[1]), usage_key(stored[3]), crossed, other_attempt])

    assert found.keys == {usage_key(stored[1]), usage_key(stored[3])}
    assert store.look_up([]) == Stored(set(), set())


def test_a_look_up_names_the_requests_with_a_billed_run(store: ClickHouseStore) -> None:
    ran, refused, superseded_only = (_event("acme", "s1", n) for n in range(3))
    refused = refused.model_copy(update={"status": UsageStatus.REJECTED})
    superseded_only = superseded_only.model_copy(update={"flags": [SUPERSEDED]})
    write_usage(store, [ran, refused, superseded_only], PRICER)
    # Another attempt of each: the request's run, not the attempt, is what counts.
    again = [(*usage_key(event)[:3], 1) for event in (ran, refused, superseded_only)]

    found = store.look_up(again)

    assert found.keys == set()
    assert found.billed == {usage_key(ran)[:3]}


def test_recent_attempts_are_all_those_of_the_window_before_the_newest(
    store: ClickHouseStore,
) -> None:
    assert store.recent_attempts(limit=10, window_s=60) == StoredAttempts([], None)
    # Created at T0 + 0, 10, ..., 90 s.
    events = [_event("acme", "s1", 10 * n) for n in range(10)]
    write_usage(store, events, PRICER)

    recent = store.recent_attempts(limit=10, window_s=30)

    assert recent.complete_from == T0 + timedelta(seconds=60)
    assert sorted(recent.attempts) == sorted(
        (usage_key(e), e.created_at) for e in events if e.created_at >= T0 + timedelta(seconds=60)
    )


def test_recent_attempts_over_the_limit_are_complete_after_the_cut(
    store: ClickHouseStore,
) -> None:
    # Two attempts share the instant the limit cuts at; neither is kept.
    events = [_event("acme", "s1", n) for n in (0, 1, 2, 2, 3)]
    events[3] = _event("acme", "s2", 2)
    write_usage(store, events, PRICER)

    recent = store.recent_attempts(limit=2, window_s=3600)

    assert recent.complete_from == T0 + timedelta(seconds=2, milliseconds=1)
    assert [key for key, _ in recent.attempts] == [usage_key(events[4])]


def test_a_repeated_block_with_its_token_lands_once_in_the_table_and_rollups(
    store: ClickHouseStore,
) -> None:
    events = [_event("acme", "sess_a", n) for n in range(4)]
    token = dedup_token(usage_key(e) for e in events)
    insert_rows(store, _rows(events), dedup_token=token)
    insert_rows(store, _rows(events), dedup_token=token)  # the ack was lost; the sink retried

    assert store.query("SELECT count() AS n FROM usage_events") == [{"n": 4}]
    for rollup in (MINUTE_ROLLUP, SESSION_ROLLUP):
        assert _totals(store, rollup)["num_attempts"] == 4


def test_redelivered_events_do_not_double_the_table_or_the_rollups(
    store: ClickHouseStore,
) -> None:
    events = [_event("acme", "sess_a", n) for n in range(5)] + [
        _event("beta", "sess_b", n, status=UsageStatus.FAILED) for n in range(3)
    ]
    write_usage(store, events, PRICER)
    plan = write_usage(store, events[:4], PRICER)  # redelivered, as after a crash
    assert (plan.num_rows, plan.num_known) == (0, 4)
    # A batch mixing known and new attempts, with a repeat inside it.
    late = _event("beta", "sess_b", 9)
    plan = write_usage(store, [*events[4:6], late, late], PRICER)
    assert (plan.num_rows, plan.num_known) == (1, 2)
    events.append(late)

    # Plain reads, no FINAL: one row per attempt.
    assert store.query("SELECT count() AS n FROM usage_events") == [{"n": 9}]
    expected = {
        "num_attempts": 9,
        "prompt_tokens": sum(e.num_prompt_tokens for e in events),
        "completion_tokens": sum(e.num_completion_tokens for e in events),
        "cost_units": sum((PRICER.charge(e).cost_units for e in events), Decimal(0)),
    }
    assert _totals(store, MINUTE_ROLLUP) == expected
    assert _totals(store, SESSION_ROLLUP) == expected

    # The reports agree.
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
    assert session["num_attempts"] == 4
    assert session["first_created_at"] == T0
    assert session["last_finished_at"] == T0 + timedelta(seconds=9, milliseconds=250)


def test_a_retried_attempt_is_its_own_row(store: ClickHouseStore) -> None:
    first = _event("acme", "sess_a", 1, status=UsageStatus.FAILED, worker_id="w0")
    retry = _event("acme", "sess_a", 1, attempt=1, worker_id="w1")
    write_usage(store, [first, retry], PRICER)

    [totals] = fetch(store, TenantTotals(tenant_id="acme"))

    assert (totals["num_requests"], totals["num_attempts"], totals["num_failed"]) == (1, 2, 1)
    assert totals["num_prompt_tokens"] == 2 * first.num_prompt_tokens


def test_reports_filter_by_tenant_and_time(store: ClickHouseStore) -> None:
    write_usage(
        store, [_event("acme", "s", n) for n in range(10)] + [_event("beta", "s", 0)], PRICER
    )

    rows = fetch(
        store,
        TenantTotals(
            tenant_id="acme", since=T0 + timedelta(seconds=2), until=T0 + timedelta(seconds=5)
        ),
    )

    assert [(r["tenant_id"], r["num_attempts"]) for r in rows] == [("acme", 3)]


def test_prices_are_copied_once_and_a_changed_version_is_refused(
    store: ClickHouseStore,
) -> None:
    book = read_price_book(BUNDLED_PRICES)
    assert store.sync_prices(book) == len(book.prices)
    assert store.sync_prices(book) == 0
    [price] = [p for p in book.prices if p.model == "tiny-llama"]
    later = Price(**{**price.__dict__, "version": 2, "effective_from": T0})
    assert store.sync_prices(PriceBook([*book.prices, later])) == 1

    changed = Price(**{**price.__dict__, "output_per_1k": price.output_per_1k * 2})
    with pytest.raises(PriceConflict, match="version 1 of model 'tiny-llama'"):
        store.sync_prices(PriceBook([changed]))
    rows = store.query("SELECT model, version FROM prices FINAL ORDER BY model, version")
    assert [(r["model"], r["version"]) for r in rows] == [
        ("*", 1),
        ("tiny-llama", 1),
        ("tiny-llama", 2),
    ]


def test_chdb_path_reads_only_directory_dsns() -> None:
    assert chdb_path("chdb:///var/lib/tb/clickhouse") == "/var/lib/tb/clickhouse"
    assert chdb_path("chdb://memory") is None
    assert chdb_path("chdb://memory/db") is None
    assert chdb_path("http://user:pw@host:8123/db") is None


@pytest.mark.parametrize(
    "at",
    [
        datetime(2026, 3, 1, 12, 0, 0, 999_999, tzinfo=UTC),
        datetime(2026, 3, 1, 14, 0, 0, 1_500, tzinfo=timezone(timedelta(hours=2))),
        datetime(2026, 3, 1, 12, 0, 0, 123_456),  # naive: UTC
        datetime(1969, 12, 31, 23, 59, 59, 999_500, tzinfo=UTC),
    ],
)
def test_timestamps_are_written_as_the_ticks_clickhouse_connect_would_write(
    at: datetime,
) -> None:
    column = cast(DateTime64, get_from_name("DateTime64(3, 'UTC')"))
    aware = at if at.tzinfo else at.replace(tzinfo=UTC)

    assert ticks(at) == column._datetime64_ticks(aware)


def test_an_insert_keeps_no_column_alive(store: ClickHouseStore) -> None:
    events = [_event("acme", "sess_a", n) for n in range(3)]
    plan = plan_keyed_columns([(usage_key(e), e) for e in events], set(), PRICER)
    before = [sys.getrefcount(column) for column in [plan.columns, *plan.columns]]

    gc.disable()  # as the sink does while a batch is in hand
    try:
        store.insert_columns(plan.columns, dedup_token=plan.dedup_token)
        # Nothing left holding them, not even garbage that waits for the cycle collector.
        after = [sys.getrefcount(column) for column in [plan.columns, *plan.columns]]
    finally:
        gc.enable()
    assert after == before


def test_a_block_is_not_merged_on_insert_so_each_attempt_must_come_once(
    store: ClickHouseStore,
) -> None:
    event = _event("acme", "sess_a", 1)
    once = plan_keyed_columns([(usage_key(event), event)], set(), PRICER)
    twice = [[*column, *column] for column in once.columns]  # what the sink never sends

    store.insert_columns(twice, dedup_token="twice")

    # The merge on insert is off (the sink's blocks hold each attempt once); FINAL reads
    # stay exact even so.
    assert store.query("SELECT count() AS n FROM usage_events") == [{"n": 2}]
    assert store.query("SELECT count() AS n FROM usage_events FINAL") == [{"n": 1}]


def test_a_block_over_many_partitions_is_written_once_not_refused(
    store: ClickHouseStore,
) -> None:
    # usage is partitioned by month, spans by day; ClickHouse refuses a block over more
    # than 100 partitions by default, and the sinks would retry it forever
    months = [datetime(2000 + n // 12, n % 12 + 1, 1, tzinfo=UTC) for n in range(150)]
    events = [_event("acme", "s", n, created_at=at, finished_at=at) for n, at in enumerate(months)]
    plan = plan_keyed_columns([(usage_key(e), e) for e in events], set(), PRICER)
    store.insert_columns(plan.columns, dedup_token=plan.dedup_token)
    store.insert_columns(plan.columns, dedup_token=plan.dedup_token)  # a retry: dropped
    assert store.query("SELECT count() AS n FROM usage_events") == [{"n": 150}]

    day_ns = 86_400 * 10**9
    start_ns = (time.time_ns() // day_ns) * day_ns  # from today: inside the spans' TTL
    spans = [
        {
            "trace_id": "a" * 32,
            "span_id": f"{day:016x}",
            "name": "job.admit",
            "service": "tokenbus-job",
            "start_ns": start_ns + day * day_ns,
            "end_ns": start_ns + day * day_ns + 1_000,
        }
        for day in range(101)
    ]
    batch = decode(SpanBatch, orjson.dumps({"tenant_id": "acme", "spans": spans}))
    store.insert_spans(span_rows(batch))
    assert store.query("SELECT count() AS n FROM spans") == [{"n": 101}]


def test_columns_store_what_rows_store(store: ClickHouseStore) -> None:
    events = [
        _event("acme", "sess_a", n, worker_id="w0", ttft_ms=1.5 * n, flags=["x"] * (n % 2))
        for n in range(4)
    ] + [_event("beta", "sess_b", 1, status=UsageStatus.FAILED, error_code="oom")]
    as_rows = [e.model_copy(update={"tenant_id": f"{e.tenant_id}-rows"}) for e in events]
    insert_rows(store, _rows(as_rows), dedup_token="rows")
    keyed = [(usage_key(e), e) for e in events]
    plan = plan_keyed_columns(keyed, set(), PRICER)
    store.insert_columns(plan.columns, dedup_token=plan.dedup_token)
    store.insert_columns(plan.columns, dedup_token=plan.dedup_token)  # a retry: dropped

    def stored(suffix: str) -> list[dict[str, Any]]:
        rows = store.query(
            "SELECT * EXCEPT inserted_at FROM usage_events"
            " WHERE endsWith(tenant_id, {suffix:String}) ORDER BY tenant_id, request_id",
            {"suffix": suffix},
        )
        return [{**row, "tenant_id": row["tenant_id"].removesuffix(suffix)} for row in rows]

    by_rows = stored("-rows")
    assert len(by_rows) == len(events)
    assert [r for r in stored("") if not r["tenant_id"].endswith("-rows")] == by_rows


def test_batch_lines_are_stored_with_their_batch_and_summed_per_batch(
    store: ClickHouseStore,
) -> None:
    lines = [_event("acme", "s", n, batch_id="batch_a", priority=2) for n in range(6)]
    lines += [_event("acme", "s", n, batch_id="batch_b", priority=2) for n in range(6, 8)]
    lines += [_event("beta", "s", 0, batch_id="batch_a", priority=2)]  # same id, other tenant
    interactive = [_event("acme", "i", n) for n in range(3)]
    write_usage(store, lines + interactive, PRICER)

    rows = fetch(store, BatchTotals(tenant_id="acme"))
    sql, values = dashboard_query("spend_per_batch").to_sql({"tenant": "acme"})
    dashboard = store.query(sql, values)

    def billed(events: list[UsageEvent]) -> Decimal:
        return sum((PRICER.charge(e).billed_units for e in events), Decimal(0))

    assert [(r["batch_id"], r["num_attempts"], r["billed_units"]) for r in rows] == [
        ("batch_a", 6, billed(lines[:6])),
        ("batch_b", 2, billed(lines[6:8])),
    ]
    costliest_first = [("batch_a", billed(lines[:6])), ("batch_b", billed(lines[6:8]))]
    assert [(r["batch_id"], r["billed_units"]) for r in dashboard] == costliest_first
    # At half the list price: the same work outside a batch costs twice as much.
    full = [e.model_copy(update={"batch_id": None}) for e in lines[:6]]
    assert billed(full) == 2 * billed(lines[:6]) > 0
    [one] = fetch(store, BatchTotals(tenant_id="beta", batch_id="batch_a"))
    assert (one["tenant_id"], one["num_attempts"]) == ("beta", 1)
    stored = store.query("SELECT batch_id FROM usage_events WHERE session_id = 'i'")
    assert [r["batch_id"] for r in stored] == ["", "", ""]
