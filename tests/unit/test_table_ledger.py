"""The job's changelog-backed ledger and spend store: expired entries are forgotten from
the head of an index kept in expiry order, never by a pass over the live ones."""

from __future__ import annotations

from typing import Any, cast

import orjson

from stream_jobs.app import TableLedger, TableSpendStore, _expired
from stream_jobs.budgets import Reservation
from stream_jobs.ledger import Entry, Forward, State
from tests.unit.fakes import ChangelogTable


def test_expired_takes_the_expired_head_of_an_index_in_expiry_order() -> None:
    index = {f"r{n}": float(n) for n in range(200)}
    assert _expired(index, now=2.5) == ["r0", "r1", "r2"]
    assert _expired(index, now=-1.0) == []
    assert _expired(index, now=1e9) == [f"r{n}" for n in range(64)]  # a bounded share


def entry(expires_at: float) -> Entry:
    return Entry(State.DONE, "replies", expires_at)


def test_a_rewritten_entry_moves_to_the_end_of_its_tenant_s_index() -> None:
    table: dict[bytes, bytes] = {}
    ledger = TableLedger(cast(Any, table))
    ledger.put("acme", "a", entry(10.0))
    ledger.put("acme", "b", entry(20.0))
    ledger.put("acme", "a", entry(30.0))  # a later state of "a": it expires last now
    ledger.sweep("acme", now=25.0)
    assert set(table) == {b"acme/a"}
    assert ledger.get("acme", "a") == entry(30.0)


def test_a_restarted_ledger_indexes_its_table_in_expiry_order() -> None:
    table: dict[bytes, bytes] = {}
    first = TableLedger(cast(Any, table))
    for n, expires_at in enumerate((50.0, 10.0, 40.0, 20.0, 30.0)):
        first.put("acme", f"r{n}", entry(expires_at))
    first.put("globex", "g", entry(5.0))
    restarted = TableLedger(cast(Any, dict(reversed(list(table.items())))))
    restarted.sweep("acme", now=35.0)
    assert {rid for rid in ("r0", "r1", "r2", "r3", "r4") if restarted.get("acme", rid)} == {
        "r0",
        "r2",
    }
    assert restarted.get("globex", "g") is not None  # another tenant's: its own requests sweep it


def test_a_sweep_forgets_a_bounded_share_per_call() -> None:
    table: dict[bytes, bytes] = {}
    ledger = TableLedger(cast(Any, table))
    for n in range(100):
        ledger.put("acme", f"r{n}", entry(float(n)))
    ledger.sweep("acme", now=1e9)
    assert len(table) == 36
    ledger.sweep("acme", now=1e9)
    assert table == {}


def test_the_spend_store_forgets_settled_reservations_in_expiry_order() -> None:
    spend: dict[bytes, bytes] = {}
    reservations: dict[bytes, bytes] = {}
    store = TableSpendStore(cast(Any, spend), cast(Any, reservations), cast(Any, {}))

    def settled(expires_at: float) -> Reservation:
        return Reservation(10, (), attempts=(0,), expires_at=expires_at)

    store.put_reservation("acme", "a", settled(10.0))
    store.put_reservation("acme", "b", settled(20.0))
    store.put_reservation("acme", "c", Reservation(10, ()))
    store.put_reservation("acme", "a", settled(30.0))  # moved to the end
    store.sweep("acme", now=25.0)
    assert store.reservation("acme", "a") is not None
    assert store.reservation("acme", "b") is None
    assert store.reservation("acme", "c") is not None  # not settled: never swept


def test_a_forward_is_written_to_its_tenant_s_partition_and_found_again_by_it() -> None:
    table = ChangelogTable()
    ledger = TableLedger(cast(Any, table))
    on_3 = Entry(State.FORWARDED, "replies", 50.0, 0, Forward(3, "tokenbus.worker.w", 0, 7))
    on_1 = Entry(State.FORWARDED, "replies", 50.0, 0, Forward(1, "tokenbus.worker.w", 0, 8))
    ledger.put_at(3, "acme", "a", on_3)
    ledger.put_at(1, "globex", "g", on_1)
    assert [(p, k) for p, k, _ in table.sent] == [(3, b"acme/a"), (1, b"globex/g")]
    assert ledger.get("acme", "a") == on_3
    table[b"acme/done"] = orjson.dumps(entry(50.0).to_json())
    table[b"acme/old"] = orjson.dumps(Entry(State.FORWARDED, "replies", 50.0).to_json())
    assert TableLedger(cast(Any, table)).forwarded({3}, now=10.0) == [("acme", "a", on_3)]
    assert ledger.forwarded({1, 3}, now=60.0) == []  # expired
    ledger.sweep("acme", now=60.0)
    assert ledger.get("acme", "a") is None  # put_at entries are swept like any other
