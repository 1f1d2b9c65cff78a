"""The index of recent attempts: complete from its horizon, and still so when it forgets."""

from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import pytest

from billing.dedup import UsageKey
from billing.recent import RecentAttempts

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _key(n: int) -> UsageKey:
    return ("acme", "sess_1", f"req_{n}", 0)


def test_an_index_of_an_empty_table_is_sure_of_every_new_attempt() -> None:
    index = RecentAttempts(capacity=10)

    assert index.horizon is None
    assert not index.is_unsure(_key(0), T0 - timedelta(days=400))
    index.add([(_key(0), T0)])
    assert index.is_unsure(_key(0), T0)
    assert not index.is_unsure(_key(1), T0)
    assert len(index) == 1


def test_attempts_created_before_the_horizon_are_unsure() -> None:
    index = RecentAttempts.from_stored([(_key(0), T0)], T0 - timedelta(minutes=1), capacity=10)

    assert index.horizon == T0 - timedelta(minutes=1)
    assert index.is_unsure(_key(1), T0 - timedelta(minutes=1, milliseconds=1))
    assert not index.is_unsure(_key(1), T0 - timedelta(minutes=1))
    assert index.is_unsure(_key(0), T0)
    # Adding an attempt older than the horizon keeps nothing: it is unsure anyway.
    index.add([(_key(2), T0 - timedelta(hours=1))])
    assert len(index) == 1


def test_a_naive_created_at_is_read_as_utc() -> None:
    index = RecentAttempts(capacity=10, horizon=T0)

    assert index.is_unsure(_key(1), datetime(2026, 3, 1, 11, 59, 59))
    assert not index.is_unsure(_key(1), datetime(2026, 3, 1, 12, 0, 0))


def test_over_capacity_it_forgets_whole_oldest_minutes_and_moves_its_horizon() -> None:
    index = RecentAttempts(capacity=3)
    index.add([(_key(0), T0), (_key(1), T0 + timedelta(seconds=30))])
    index.add([(_key(2), T0 + timedelta(minutes=1)), (_key(3), T0 + timedelta(minutes=2))])

    # The minute of T0 is gone, so the index is complete from the next minute only.
    assert len(index) == 2
    assert index.horizon == T0 + timedelta(minutes=1)
    assert index.is_unsure(_key(0), T0)  # forgotten: before the horizon, so looked up
    assert index.is_unsure(_key(9), T0 + timedelta(seconds=59))
    assert index.is_unsure(_key(2), T0 + timedelta(minutes=1))
    assert not index.is_unsure(_key(9), T0 + timedelta(minutes=1))


def test_a_key_seen_again_later_survives_the_forgetting_of_its_first_minute() -> None:
    index = RecentAttempts(capacity=2)
    index.add([(_key(0), T0), (_key(1), T0)])
    index.add([(_key(0), T0 + timedelta(minutes=5))])  # the same hash, a later minute
    index.add([(_key(2), T0 + timedelta(minutes=6))])

    assert index.horizon == T0 + timedelta(minutes=1)
    assert index.is_unsure(_key(0), T0 + timedelta(minutes=5))
    assert len(index) == 2


class _Event(NamedTuple):
    created_at: datetime


@pytest.mark.parametrize("horizon", [None, T0 - timedelta(minutes=1)])
def test_unsure_keys_are_the_keys_is_unsure_names(horizon: datetime | None) -> None:
    index = RecentAttempts.from_stored(
        [(_key(i), T0 + timedelta(seconds=i)) for i in range(0, 40, 3)], horizon, 1_000
    )
    keyed = [
        (_key(i), _Event(T0 + timedelta(seconds=i - 90) if i % 5 else T0.replace(tzinfo=None)))
        for i in range(40)
    ]
    expected = [key for key, event in keyed if index.is_unsure(key, event.created_at)]
    assert index.unsure_keys(keyed) == expected
    assert expected  # the stored ones at least
    if horizon is not None:
        assert len(expected) > len(range(0, 40, 3))  # and some older than the horizon


def _ticks(at: datetime) -> int:
    return (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


@pytest.mark.parametrize("capacity", [3, 1_000])
@pytest.mark.parametrize("horizon", [None, T0, T0 + timedelta(seconds=50, milliseconds=1)])
def test_adding_ticks_is_adding_the_instants(capacity: int, horizon: datetime | None) -> None:
    batches = [
        [(_key(n), T0 + timedelta(seconds=10 * n, microseconds=999 * n)) for n in range(-3, 8)],
        [
            (_key(1), T0 + timedelta(minutes=3)),  # again, a later minute
            (_key(20), T0 - timedelta(microseconds=1)),
            (_key(21), T0 + timedelta(seconds=50, microseconds=500)),  # in the horizon's ms
            (_key(22), T0 + timedelta(seconds=50, milliseconds=1)),
            (_key(23), T0 + timedelta(minutes=1, microseconds=-1)),
        ],
    ]
    by_instant = RecentAttempts(capacity, horizon)
    by_ticks = RecentAttempts(capacity, horizon)
    for attempts in batches:
        by_instant.add(attempts)
        by_ticks.add_ticks([key for key, _ in attempts], [_ticks(at) for _, at in attempts])

        assert by_ticks._minute_of == by_instant._minute_of
        assert by_ticks._by_minute == by_instant._by_minute
        assert by_ticks.horizon == by_instant.horizon


def test_ticks_keep_every_attempt_at_or_after_a_horizon_between_ticks() -> None:
    horizon = T0 + timedelta(microseconds=500)  # not a whole millisecond
    index = RecentAttempts(capacity=10, horizon=horizon)

    index.add_ticks([_key(0), _key(1), _key(2)], [_ticks(T0) - 1, _ticks(T0), _ticks(T0) + 1])

    # Tick T0 may stand for an instant at or after the horizon: kept, looked up if seen.
    assert not index.is_unsure(_key(0), T0 + timedelta(milliseconds=5))
    assert index.is_unsure(_key(1), T0 + timedelta(milliseconds=5))
    assert index.is_unsure(_key(2), T0 + timedelta(milliseconds=5))


def _added_one_by_one(
    index: RecentAttempts, keys: list[UsageKey], ticks: list[int]
) -> tuple[dict[int, int], dict[int, list[int]]]:
    """What ``add_ticks`` keeps, by its rule, one attempt at a time (before trimming)."""
    minute_of, by_minute = dict(index._minute_of), {m: list(d) for m, d in index._by_minute.items()}
    for key, at in zip(keys, ticks, strict=True):
        if index.horizon is not None and at + 1 <= _ticks(index.horizon):
            continue
        known = minute_of.get(hash(key))
        if known is None or known < at // 60_000:
            minute_of[hash(key)] = at // 60_000
            by_minute.setdefault(at // 60_000, []).append(hash(key))
    return minute_of, by_minute


@pytest.mark.parametrize(
    "batch",
    [
        [(n, 1_000 * n) for n in range(50)],  # one minute: the fast path
        [(n, 7_000 * n) for n in range(50)],  # six minutes: the fast path
        [(n, 61_000 * n) for n in range(20)],  # twenty minutes: one by one
        [(1, 1_000), (2, 2_000), (1, 70_000)],  # a repeat: one by one
        [(0, 200_000), (90, 200_000)],  # a key held already: one by one
        [(91, 59_000), (92, 61_000)],  # one before the horizon: one by one
    ],
)
def test_a_batch_of_ticks_is_added_as_one_at_a_time_would(batch: list[tuple[int, int]]) -> None:
    base = _ticks(T0)
    index = RecentAttempts.from_stored([(_key(0), T0)], T0 + timedelta(minutes=1), 1_000)
    keys, ticks = [_key(n) for n, _ in batch], [base + dt for _, dt in batch]
    expected = _added_one_by_one(index, keys, ticks)

    index.add_ticks(keys, ticks)

    assert (index._minute_of, index._by_minute) == expected


def test_keys_without_ticks_are_refused() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 ticks"):
        RecentAttempts(10).add_ticks([_key(0), _key(1)], [0])


@pytest.mark.parametrize("horizon", [None, T0])
def test_no_key_is_unsure_when_none_is_held_or_old(horizon: datetime | None) -> None:
    index = RecentAttempts.from_stored([(_key(0), T0)], horizon, 1_000)
    keyed = [(_key(n), _Event(T0 + timedelta(seconds=n))) for n in range(1, 30)]
    naive = [(key, _Event(event.created_at.replace(tzinfo=None))) for key, event in keyed]

    assert index.unsure_keys(keyed) == []
    assert index.unsure_keys(keyed[:5] + naive[5:]) == []  # mixed: asked one by one
    assert index.unsure_keys([*keyed, (_key(0), _Event(T0))]) == [_key(0)]


def test_a_stored_later_attempt_makes_its_request_first_attempt_unsure() -> None:
    # A first attempt reported after a later one (its worker presumed lost, only slow)
    # must be looked up: its request has a billed run.
    index = RecentAttempts(capacity=100)
    later = (*_key(1)[:3], 2)
    index.add([(later, T0)])

    assert index.is_unsure((*_key(1)[:3], 0), T0)
    assert not index.is_unsure(_key(2), T0)


def test_a_copy_created_apart_from_its_stored_attempt_is_looked_up() -> None:
    # A request admitted again after the job lost its ledger entry runs again under the
    # same key, created at its second admission: the stored copy may be older than the
    # horizon of an index read back after a restart, the new one newer.
    stored_at, horizon = T0, T0 + timedelta(minutes=2)
    index = RecentAttempts.from_stored(
        [(_key(1), T0 + timedelta(minutes=3))], horizon, capacity=10, margin_s=600
    )
    assert index.sure_from == horizon + timedelta(minutes=10)
    copy_created = stored_at + timedelta(minutes=5)  # after the horizon, _key(0) not held
    assert index.is_unsure(_key(0), copy_created)
    assert index.unsure_keys([(_key(0), _Event(copy_created))]) == [_key(0)]
    # Created the margin after the horizon, any copy of it is at or after the horizon:
    # held if stored, so one not held is new.
    late = horizon + timedelta(minutes=10)
    assert not index.is_unsure(_key(0), late)
    assert index.unsure_keys([(_key(0), _Event(late))]) == []
    assert index.unsure_keys([(_key(1), _Event(late))]) == [_key(1)]


def test_the_margin_follows_the_horizon_when_the_index_forgets() -> None:
    index = RecentAttempts(capacity=1, margin_s=60)
    index.add([(_key(0), T0)])
    assert index.sure_from is None  # an empty table's index holds every attempt
    index.add([(_key(1), T0 + timedelta(minutes=5))])
    assert index.horizon == T0 + timedelta(minutes=1)
    assert index.sure_from == T0 + timedelta(minutes=2)
    assert index.is_unsure(_key(7), T0 + timedelta(minutes=1, seconds=59))
    assert not index.is_unsure(_key(7), T0 + timedelta(minutes=2))
