"""The job's quota store over Faust tables, with dicts standing in for the tables: a
request writes O(1) records, and a new store over the same tables (a restarted job
after changelog recovery) has the same counts and still knows every reservation."""

from __future__ import annotations

from typing import Any, cast

from faust.types import EventT, TableT

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


def store_over(windows: Table, reservations: Table) -> TableWindowStore:
    return TableWindowStore(cast(TableT[bytes, bytes], windows), cast(Any, reservations))


def test_a_request_writes_its_own_reservation_and_the_sums_only() -> None:
    windows, reservations = Table(), Table()
    store = store_over(windows, reservations)
    for n in range(50):
        state = store.load("acme")
        assert reserve(state, f"r{n}", 10, LIMITS, now=100.0 + n * 0.1).admitted
        store.save("acme", state)
        store.flush()
    assert reservations.writes == 50 and len(reservations) == 50
    assert b"acme/r49" in reservations and b"r49" not in windows[b"acme"]

    state = store.load("acme")
    settle(state, "r0", 4, now=105.0)
    store.save("acme", state)
    store.flush()
    assert reservations.writes == 51  # the settled reservation, nothing else


def test_a_new_store_over_the_same_tables_resumes_the_counts() -> None:
    windows, reservations = Table(), Table()
    first = store_over(windows, reservations)
    for tenant in ("acme", "globex"):
        state = first.load(tenant)
        for n in range(3):
            reserve(state, f"{tenant}-{n}", 100, LIMITS, now=10.0 + n)
        settle(state, f"{tenant}-0", 40, now=13.0)
        release(state, f"{tenant}-2", now=13.0)
        first.save(tenant, state)
        first.flush()

    restarted = store_over(windows, reservations)
    state = restarted.load("acme")
    assert state.used() == (140, 2)
    # A redelivered request is known: settled ones are duplicates, none is charged again.
    again = reserve(state, "acme-0", 100, LIMITS, now=14.0)
    assert again.admitted and again.duplicate and state.used() == (140, 2)
    assert set(state.reservations) == {"acme-0", "acme-1"}
    assert set(restarted.load("globex").reservations) == {"globex-0", "globex-1"}


def test_reservations_leaving_the_window_are_deleted_from_the_table() -> None:
    windows, reservations = Table(), Table()
    store = store_over(windows, reservations)
    state = store.load("acme")
    reserve(state, "old", 100, LIMITS, now=0.0)
    reserve(state, "new", 100, LIMITS, now=30.0)
    store.save("acme", state)
    store.flush()
    state = store.load("acme")
    reserve(state, "later", 100, LIMITS, now=65.0)
    store.save("acme", state)
    store.flush()
    assert set(reservations) == {b"acme/new", b"acme/later"}
    assert state.used() == (200, 2)


def test_a_tenant_back_after_a_quiet_minute_deletes_a_bounded_share_per_request() -> None:
    windows, reservations = Table(), Table()
    store = store_over(windows, reservations)
    state = store.load("acme")
    for n in range(300):
        reserve(state, f"r{n}", 1, LIMITS_BIG, now=n * 0.1)
    before = len(reservations)
    reserve(state, "back", 1, LIMITS_BIG, now=200.0)
    assert before - len(reservations) == EXPIRE_PER_CALL - 1  # and one written: "back"
    for n in range(10):
        reserve(state, f"more{n}", 1, LIMITS_BIG, now=200.0 + n)
    assert all(not key.startswith(b"acme/r") for key in reservations)


def test_a_batch_writes_each_tenants_sums_once_at_flush() -> None:
    windows, reservations = Table(), Table()
    store = store_over(windows, reservations)
    for n in range(20):
        tenant = ("acme", "globex")[n % 2]
        state = store.load(tenant)
        assert reserve(state, f"r{n}", 10, LIMITS, now=100.0 + n * 0.1).admitted
        store.save(tenant, state)
    assert windows.writes == 0  # kept back until the batch is judged
    store.flush()
    assert windows.writes == 2 and set(windows) == {b"acme", b"globex"}
    assert reservations.writes == 20
    store.flush()
    assert windows.writes == 2  # nothing left to write

    restarted = store_over(windows, reservations)
    assert restarted.load("acme").used() == (100, 10)


class Event:
    """What the store keeps of a Faust event: only that it is one (weakly referenced)."""

    def __init__(self, partition: int) -> None:
        self.partition = partition


class EventTable(Table):
    """Records the partition of the event current at each write, as Faust's changelog
    does (``Table.on_key_set`` reads ``faust.streams.current_event()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.partitions: dict[bytes, int | None] = {}

    def __setitem__(self, key: bytes, value: bytes) -> None:
        from faust.streams import current_event

        event = cast(Any, current_event())
        self.partitions[key] = event.partition if event is not None else None
        super().__setitem__(key, value)


def test_a_flush_writes_each_tenants_sums_under_the_event_it_was_saved_in() -> None:
    from stream_jobs.app import in_event

    windows, reservations = EventTable(), Table()
    store = store_over(windows, reservations)
    for n, (tenant, event) in enumerate((("acme", Event(0)), ("globex", Event(3)))):
        with in_event(cast(Any, event)):
            state = store.load(tenant)
            reserve(state, f"r{n}", 10, LIMITS, now=100.0)
            store.save(tenant, state)
    store.flush()  # outside both events, as the agent runs it after the batch
    assert windows.partitions == {b"acme": 0, b"globex": 3}


def test_in_event_makes_the_event_current_and_restores_the_one_before() -> None:
    from faust.streams import current_event

    from stream_jobs.app import in_event

    outer, inner = cast(EventT[Any], Event(1)), cast(EventT[Any], Event(2))
    with in_event(outer):
        with in_event(inner):
            assert current_event() is inner
        assert current_event() is outer
        with in_event(None):
            assert current_event() is outer  # none given: the current one stays
    assert current_event() is None


def test_a_restarted_store_keeps_a_tenant_s_batch_window_apart_from_its_own() -> None:
    windows, reservations = Table(), Table()
    first = store_over(windows, reservations)
    own, batch = window_key("acme"), window_key("acme", "b1")
    for window, num_tokens in ((own, 100), (batch, 300)):
        state = first.load(window)
        reserve(state, f"{window}-r".replace("/", "-"), num_tokens, LIMITS, now=10.0)
        first.save(window, state)
    first.flush()  # the sums are written at the batch's end
    assert set(reservations) == {b"acme/acme-r", b"acme/batch/acme-batch-r"}

    restarted = store_over(windows, reservations)  # recovered from the changelogs
    assert restarted.load(batch).used() == (300, 1)
    assert set(restarted.load(batch).reservations) == {"acme-batch-r"}
    assert restarted.load(own).used() == (100, 1)
    assert set(restarted.load(own).reservations) == {"acme-r"}
