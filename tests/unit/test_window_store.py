"""The job's quota store over a Faust table, with a dict standing in for the table: a
request writes its own reservation and nothing else, and a new store over the same table
(a restarted job after changelog recovery) has the same counts and still knows every
reservation."""

from __future__ import annotations

from typing import cast

from faust.types import TableT

from stream_jobs.app import TableWindowStore
from stream_jobs.window import EXPIRE_PER_CALL, Limits, release, reserve, settle, window_key

LIMITS = Limits(tpm=10_000, rpm=100)
LIMITS_BIG = Limits(tpm=10**9, rpm=10**6)


class Table(dict[bytes, bytes]):
    """What the store uses of a Faust table; counts the records written."""

    writes = 0

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.writes += 1
        super().__setitem__(key, value)


def store_over(reservations: Table) -> TableWindowStore:
    return TableWindowStore(cast(TableT[bytes, bytes], reservations))


def test_a_request_writes_its_own_reservation_only() -> None:
    reservations = Table()
    store = store_over(reservations)
    for n in range(50):
        state = store.load("acme")
        assert reserve(state, f"r{n}", 10, LIMITS, now=100.0 + n * 0.1).admitted
    assert reservations.writes == 50 and len(reservations) == 50
    assert b"acme/r49" in reservations

    state = store.load("acme")
    settle(state, "r0", 4, now=105.0)
    assert reservations.writes == 51  # the settled reservation, nothing else


def test_a_new_store_over_the_same_tables_resumes_the_counts() -> None:
    reservations = Table()
    first = store_over(reservations)
    for tenant in ("acme", "globex"):
        state = first.load(tenant)
        for n in range(3):
            reserve(state, f"{tenant}-{n}", 100, LIMITS, now=10.0 + n)
        settle(state, f"{tenant}-0", 40, now=13.0)
        release(state, f"{tenant}-2", now=13.0)

    restarted = store_over(reservations)
    state = restarted.load("acme")
    assert state.used() == (140, 2)
    # A redelivered request is known: settled ones are duplicates, none is charged again.
    again = reserve(state, "acme-0", 100, LIMITS, now=14.0)
    assert again.admitted and again.duplicate and state.used() == (140, 2)
    assert set(state.reservations) == {"acme-0", "acme-1"}
    assert set(restarted.load("globex").reservations) == {"globex-0", "globex-1"}


def test_reservations_leaving_the_window_are_deleted_from_the_table() -> None:
    reservations = Table()
    store = store_over(reservations)
    state = store.load("acme")
    reserve(state, "old", 100, LIMITS, now=0.0)
    reserve(state, "new", 100, LIMITS, now=30.0)
    state = store.load("acme")
    reserve(state, "later", 100, LIMITS, now=65.0)
    assert set(reservations) == {b"acme/new", b"acme/later"}
    assert state.used() == (200, 2)


def test_a_tenant_back_after_a_quiet_minute_deletes_a_bounded_share_per_request() -> None:
    reservations = Table()
    store = store_over(reservations)
    state = store.load("acme")
    for n in range(300):
        reserve(state, f"r{n}", 1, LIMITS_BIG, now=n * 0.1)
    before = len(reservations)
    reserve(state, "back", 1, LIMITS_BIG, now=200.0)
    assert before - len(reservations) == EXPIRE_PER_CALL - 1  # and one written: "back"
    for n in range(10):
        reserve(state, f"more{n}", 1, LIMITS_BIG, now=200.0 + n)
    assert all(not key.startswith(b"acme/r") for key in reservations)


def test_a_restarted_store_keeps_a_tenant_s_batch_window_apart_from_its_own() -> None:
    reservations = Table()
    first = store_over(reservations)
    own, batch = window_key("acme"), window_key("acme", "b1")
    for window, num_tokens in ((own, 100), (batch, 300)):
        state = first.load(window)
        reserve(state, f"{window}-r".replace("/", "-"), num_tokens, LIMITS, now=10.0)
    assert set(reservations) == {b"acme/acme-r", b"acme/batch/acme-batch-r"}

    restarted = store_over(reservations)  # recovered from the changelogs
    assert restarted.load(batch).used() == (300, 1)
    assert set(restarted.load(batch).reservations) == {"acme-batch-r"}
    assert restarted.load(own).used() == (100, 1)
    assert set(restarted.load(own).reservations) == {"acme-r"}
