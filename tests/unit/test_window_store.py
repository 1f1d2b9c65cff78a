"""The job's quota windows, kept in the request ledger: a request's reservation travels
in its ledger entry and costs no record of its own, and a job restarted over the same
table (after changelog recovery) rebuilds every window with the same counts.

The store's own tests use a dict for the Faust table; the dispatcher's run on the real
``TableLedger`` and ``TableWindowStore`` over one such table, as the job wires them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from stream_jobs.app import TableLedger, TableWindowStore
from stream_jobs.dispatcher import Dispatcher, Outcome
from stream_jobs.ledger import Entry, Forward, Reserved, State
from stream_jobs.window import Limits, reserve, window_key
from tests.unit.fakes import (
    ChangelogTable,
    Forwards,
    ManualClock,
    Recorder,
    Replies,
    bus_authenticator,
    cancel,
)
from tests.unit.test_dispatcher import admit, heartbeat, request, usage_of
from tokenbus.config import Settings

LIMITS = Limits(tpm=10_000, rpm=100)


def put(table: ChangelogTable, tenant: str, request_id: str, entry: Entry) -> None:
    table[f"{tenant}/{request_id}".encode()] = orjson.dumps(entry.to_json())


def store_over(table: ChangelogTable) -> TableWindowStore:
    return TableWindowStore(TableLedger(cast(Any, table)))


def test_a_store_rebuilds_each_window_from_the_reservations_in_the_entries() -> None:
    table = ChangelogTable()
    batch = window_key("acme", "b1")
    on_w = Forward(0, "w", 0, 1)
    put(
        table,
        "acme",
        "r1",
        Entry(State.FORWARDED, "r", 900.0, 0, on_w, 0, Reserved("acme", 100, 300, 0)),
    )
    put(
        table, "acme", "r2", Entry(State.DONE, "r", 900.0, 5, None, 0, Reserved("acme", 101, 40, 1))
    )
    put(table, "acme", "r3", Entry(State.DONE, "r", 900.0))  # refused: never reserved
    put(
        table,
        "acme",
        "l1",
        Entry(State.FORWARDED, "r", 900.0, 0, on_w, 0, Reserved(batch, 100, 500, 0)),
    )
    put(
        table,
        "globex",
        "g1",
        Entry(State.ADMITTED, "r", 900.0, 0, None, 1, Reserved("globex", 100, 7, 0)),
    )

    store = store_over(table)
    acme = store.load("acme")
    assert acme.used() == (340, 2) and acme.buckets == {100: [300, 1], 101: [40, 1]}
    assert dict(acme.reservations.items()) == {"r1": [100, 300, 0], "r2": [101, 40, 1]}
    assert store.load(batch).used() == (500, 1)
    assert store.load("globex").used() == (7, 1)
    # A redelivered request is known: a settled one is a duplicate, and none is charged again.
    again = reserve(acme, "r2", 999, LIMITS, now=10.2)
    assert again.admitted and again.duplicate and acme.used() == (340, 2)
    # Out of the window by the time it is used: forgotten, not counted.
    assert reserve(store.load("globex"), "g2", 1, LIMITS, now=100.0).num_tokens_used == 1


def test_a_start_reads_the_ledger_once_for_its_index_and_every_window() -> None:
    table = ChangelogTable()
    for n in range(3):
        reserved = Reserved(f"t{n}", 100, 10, 0)
        put(table, f"t{n}", "r", Entry(State.FORWARDED, "r", 900.0, reserved=reserved))
    ledger = TableLedger(cast(Any, table))
    store = TableWindowStore(ledger)
    ledger.sweep("t0", now=10.0)
    assert [store.load(f"t{n}").used() for n in range(3)] == [(10, 1)] * 3
    assert table.reads == 1
    ledger.forget()  # partitions moved: read again, once
    store.forget()
    assert store.load("t1").used() == (10, 1) and table.reads == 2


def test_the_store_writes_nothing_itself() -> None:
    table = ChangelogTable()
    store = store_over(table)
    for n in range(20):
        assert reserve(store.load("acme"), f"r{n}", 10, LIMITS, now=10.0 + n * 0.1).admitted
    assert table.writes == 0 and store.load("acme").used() == (200, 20)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, default_priority_class=0)


def table_dispatcher(settings: Settings, recorder: Recorder, table: ChangelogTable) -> Dispatcher:
    """One run of the job over the ledger's table, wired as the job wires it."""
    ledger = TableLedger(cast(Any, table))
    return Dispatcher(
        settings,
        recorder,
        TableWindowStore(ledger),
        Replies(recorder),
        ledger,
        authenticator=bus_authenticator(settings.tenant_directory()),
        clock=ManualClock(),
        forwards=Forwards(recorder),
    )


async def test_a_request_s_quota_costs_no_record_and_a_restart_keeps_the_counts(
    settings: Settings,
) -> None:
    recorder, table = Recorder(), ChangelogTable()
    first = table_dispatcher(settings, recorder, table)
    first.observe_heartbeat(heartbeat(capacity=8))
    loop = asyncio.create_task(first.run())
    for n in (1, 2, 3):
        assert await (await admit(first, request(n))) is Outcome.FORWARDED
    # One record per request: its FORWARDED entry, with the reservation in it.
    assert table.writes == 3 and set(table) == {b"t/r1", b"t/r2", b"t/r3"}
    first.observe_usage(usage_of(1))  # r1 ran: its DONE entry keeps the settled count
    assert table.writes == 4
    loop.cancel()

    used = first._store.load("t").used()
    restarted = table_dispatcher(settings, recorder, table)
    window = restarted._store.load("t")
    assert window.used() == used
    assert window.reservations["r1"][1:] == [12, 1]  # 2 prompt + 10 completion, settled
    assert [window.reservations[f"r{n}"][2] for n in (2, 3)] == [0, 0]


async def test_a_request_answered_without_running_leaves_nothing_in_the_window(
    settings: Settings,
) -> None:
    recorder, table = Recorder(), ChangelogTable()
    first = table_dispatcher(settings, recorder, table)
    loop = asyncio.create_task(first.run())
    waiting = await admit(first, request(1))  # no worker yet: it waits
    assert first._store.load("t").used()[1] == 1
    await cancel(first, "t", "r1")
    assert await waiting is Outcome.CANCELLED
    loop.cancel()
    entry = TableLedger(cast(Any, table)).get("t", "r1")
    assert entry is not None and entry.state is State.DONE and entry.reserved is None
    assert first._store.load("t").used() == (0, 0)
    assert table_dispatcher(settings, recorder, table)._store.load("t").used() == (0, 0)
