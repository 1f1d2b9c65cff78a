"""tokenbus.tansu.fetch_wait: a consumer stalled behind the high-water mark lengthens its
fetch wait, and shortens it again once the stalls are over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from tokenbus.tansu.fetch_wait import QUIET_S, STALLS_TO_RAISE, FetchWait, stalled_partitions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stall(rule: FetchWait, times: int) -> int:
    for _ in range(times):
        wait = rule.after_fetch(stalled=True)
    return wait


def test_the_wait_doubles_only_after_stalls_in_a_row() -> None:
    rule = FetchWait(base_ms=5, cap_ms=1000, clock=Clock())
    assert stall(rule, STALLS_TO_RAISE - 1) == 5
    assert rule.after_fetch(stalled=False) == 5  # a fetch with records resets the count
    assert stall(rule, STALLS_TO_RAISE - 1) == 5
    assert rule.after_fetch(stalled=True) == 10
    assert stall(rule, STALLS_TO_RAISE) == 20


def test_the_wait_stops_at_the_cap() -> None:
    rule = FetchWait(base_ms=5, cap_ms=60, clock=Clock())
    assert stall(rule, 10 * STALLS_TO_RAISE) == 60


def test_the_wait_halves_after_a_quiet_period_down_to_the_base() -> None:
    clock = Clock()
    rule = FetchWait(base_ms=5, cap_ms=1000, clock=clock)
    assert stall(rule, 3 * STALLS_TO_RAISE) == 40
    clock.now += QUIET_S / 2
    assert rule.after_fetch(stalled=False) == 40
    clock.now += QUIET_S / 2
    assert rule.after_fetch(stalled=False) == 20
    assert rule.after_fetch(stalled=False) == 20  # one halving per quiet period
    for _ in range(5):
        clock.now += QUIET_S
        rule.after_fetch(stalled=False)
    assert rule.wait_ms == 5


def test_a_cap_at_the_base_never_raises() -> None:
    rule = FetchWait(base_ms=100, cap_ms=50, clock=Clock())
    assert stall(rule, 10 * STALLS_TO_RAISE) == 100


@dataclass
class State:
    position: int
    highwater: int | None
    has_valid_position: bool = True
    timestamp: int | None = None  # ms of the last answer without error


@dataclass
class Assignment:
    states: dict[TopicPartition, State]

    def state_value(self, tp: TopicPartition) -> State | None:
        return self.states.get(tp)


@dataclass
class Request:
    topics: list[tuple[str, list[tuple[int, int, int]]]]


@dataclass
class Fetcher:
    _records: dict[TopicPartition, Any] = field(default_factory=dict)


def test_stalled_partitions_are_those_behind_the_high_water_mark_without_records() -> None:
    behind, caught_up, got_records, moved = (TopicPartition("t", p) for p in range(4))
    assignment = Assignment(
        {
            behind: State(position=10, highwater=500),
            caught_up: State(position=500, highwater=500),
            got_records: State(position=10, highwater=500),
            moved: State(position=20, highwater=500),  # seeked while the fetch ran
        }
    )
    request = Request(
        [("t", [(0, 10, 1 << 20), (1, 500, 1 << 20), (2, 10, 1 << 20), (3, 10, 1 << 20)])]
    )
    fetcher = Fetcher(_records={got_records: object()})
    assert stalled_partitions(fetcher, assignment, request) == [behind]


def test_partitions_the_answer_left_out_or_refused_count_as_stalled() -> None:
    """A restarted consumer knows no high-water mark before a partition's first answer:
    a partition left out of every answer (or answered with an error) stalls unseen
    unless the missing answer itself counts."""
    since_ms = 1_000
    tps = [TopicPartition("t", p) for p in range(5)]
    never, stale, caught_up, moved, got_records = tps
    assignment = Assignment(
        {
            never: State(position=10, highwater=None, timestamp=None),
            stale: State(position=10, highwater=10, timestamp=since_ms - 1),
            caught_up: State(position=500, highwater=500, timestamp=since_ms + 3),
            moved: State(position=20, highwater=None, timestamp=None),  # seeked meanwhile
            got_records: State(position=10, highwater=None, timestamp=since_ms + 3),
        }
    )
    request = Request([("t", [(p, 500 if p == 2 else 10, 1 << 20) for p in range(5)])])
    fetcher = Fetcher(_records={got_records: object()})
    assert stalled_partitions(fetcher, assignment, request, since_ms) == [never, stale]
    # A fetch that failed as a whole (nothing answered: the broker unreachable) is no
    # stall: the rule is for a broker that answers slowly.
    for state in assignment.states.values():
        state.timestamp = None
    assert stalled_partitions(fetcher, assignment, request, since_ms) == []
    # Without the time the fetch was sent, only what the states say: no mark, no stall.
    assert stalled_partitions(fetcher, assignment, request) == []


def test_stalls_at_the_cap_are_told_once_per_quiet_period() -> None:
    clock = Clock()
    rule = FetchWait(base_ms=5, cap_ms=20, clock=clock)
    stall(rule, 2 * STALLS_TO_RAISE)
    assert rule.wait_ms == 20
    assert not rule.stuck()  # the stalls in a row were spent raising the wait
    stall(rule, STALLS_TO_RAISE)
    assert rule.stuck()
    stall(rule, STALLS_TO_RAISE)
    assert not rule.stuck()  # said already
    clock.now += QUIET_S
    stall(rule, 1)
    assert rule.stuck()
    rule.after_fetch(stalled=False)
    clock.now += QUIET_S
    assert not rule.stuck()  # moving again
