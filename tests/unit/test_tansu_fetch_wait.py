"""tokenbus.tansu.fetch_wait: a consumer stalled behind the high-water mark lengthens its
fetch wait, and shortens it again once the stalls are over; one that expects a record
fetches with a short wait until it comes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from tokenbus.tansu.fetch_wait import (
    QUIET_S,
    STALLS_TO_RAISE,
    FetchWait,
    LoneRequests,
    adapt_fetch_waits,
    expect_records,
    fetched_records,
    stalled_partitions,
    uninstall,
)


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


def eager(clock: Clock, *, after_quiet: bool = False) -> FetchWait:
    return FetchWait(
        base_ms=20, cap_ms=1000, clock=clock, eager_ms=2, window_s=0.05, after_quiet=after_quiet
    )


def test_an_expected_record_is_fetched_with_the_short_wait_until_it_comes() -> None:
    clock = Clock()
    rule = eager(clock)
    assert rule.current_ms == 20
    assert rule.expect() == 2
    assert rule.after_fetch(stalled=False) == 2  # an empty fetch: still expected
    clock.now += 0.01
    assert rule.after_fetch(stalled=False, num_records=1) == 20  # it came
    assert rule.after_fetch(stalled=False) == 20


def test_the_short_wait_ends_with_its_window_without_a_record() -> None:
    clock = Clock()
    rule = eager(clock)
    rule.expect()
    clock.now += 0.049
    assert rule.after_fetch(stalled=False) == 2
    clock.now += 0.002
    assert rule.after_fetch(stalled=False) == 20
    assert rule.current_ms == 20


def test_a_lone_record_after_a_quiet_spell_opens_the_window_where_asked() -> None:
    clock = Clock()
    quiet, plain = eager(clock, after_quiet=True), eager(clock)
    # The first record (after nothing at all), then the next one soon after.
    assert quiet.after_fetch(stalled=False, num_records=1) == 2
    assert plain.after_fetch(stalled=False, num_records=1) == 20
    clock.now += 0.01
    assert quiet.after_fetch(stalled=False, num_records=1) == 20  # the one expected
    clock.now += 0.049  # less than a window since the last records: not quiet
    assert quiet.after_fetch(stalled=False, num_records=1) == 20
    clock.now += 0.06  # a window and more
    assert quiet.after_fetch(stalled=False, num_records=2) == 20  # a burst: not one at a time
    clock.now += 0.06
    assert quiet.after_fetch(stalled=False, num_records=1) == 2
    assert plain.after_fetch(stalled=False, num_records=1) == 20


def test_a_raised_wait_is_never_shortened() -> None:
    """The stall rule raised it: the broker needs longer per fetch than the base."""
    clock = Clock()
    rule = eager(clock)
    assert stall(rule, STALLS_TO_RAISE) == 40
    assert rule.expect() == 40
    assert rule.after_fetch(stalled=False) == 40


def test_a_short_wait_not_below_the_base_is_off() -> None:
    clock = Clock()
    for eager_ms in (0, 20, 50):
        rule = FetchWait(base_ms=20, cap_ms=1000, clock=clock, eager_ms=eager_ms)
        assert rule.expect() == 20
        assert rule.after_fetch(stalled=False) == 20


@dataclass
class HintedFetcher:
    _fetch_max_wait_ms: int = 20
    _subscriptions: object = field(default_factory=object)


@dataclass
class Consumer:
    _fetcher: HintedFetcher | None


def test_a_hint_shortens_the_next_fetch_only_where_the_rule_is_installed() -> None:
    uninstall()
    consumer = Consumer(HintedFetcher())
    expect_records(consumer)
    assert consumer._fetcher is not None
    assert consumer._fetcher._fetch_max_wait_ms == 20  # the kafka profile: as aiokafka ships
    adapt_fetch_waits(cap_ms=1000, eager_ms=2, eager_window_ms=50)
    try:
        expect_records(Consumer(None))  # not started: no fetcher to hint
        expect_records(consumer)
        assert consumer._fetcher._fetch_max_wait_ms == 2
        adapt_fetch_waits(cap_ms=1000, eager_ms=0)
        other = Consumer(HintedFetcher())
        expect_records(other)
        assert other._fetcher is not None
        assert other._fetcher._fetch_max_wait_ms == 20
    finally:
        uninstall()


def test_requests_come_one_at_a_time_until_two_overlap() -> None:
    lone = LoneRequests()
    assert lone.idle()  # nothing ran yet
    lone.running(1)
    assert lone.idle()
    lone.running(1)
    lone.running(2)  # a second started while the first ran
    assert not lone.idle()
    lone.running(1)  # each idle moment starts a new spell
    assert lone.idle()


def test_a_fetch_counts_its_records_by_the_high_water_marks() -> None:
    got_one, got_three, empty, no_mark = (TopicPartition("t", p) for p in range(4))
    assignment = Assignment(
        {
            got_one: State(position=10, highwater=11),
            got_three: State(position=10, highwater=13),
            empty: State(position=10, highwater=10),
            no_mark: State(position=10, highwater=None),
        }
    )
    request = Request([("t", [(p, 10, 1 << 20) for p in range(4)])])
    records = {got_one: object(), got_three: object(), no_mark: object()}
    assert fetched_records(Fetcher(_records=records), assignment, request) == 5
    assert fetched_records(Fetcher(), assignment, request) == 0


def test_records_are_counted_only_where_a_lone_one_could_open_the_window() -> None:
    clock = Clock()
    quiet, plain = eager(clock, after_quiet=True), eager(clock)
    assert quiet.counts_records() and not plain.counts_records()
    quiet.after_fetch(stalled=False, num_records=3)
    assert not quiet.counts_records()  # records just came: not quiet
    clock.now += 0.06
    assert quiet.counts_records()
