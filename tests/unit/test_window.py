from __future__ import annotations

import math
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import TENANT_ID_PATTERN
from stream_jobs.window import (
    EXPIRE_PER_CALL,
    Limits,
    Reservations,
    WindowState,
    release,
    reserve,
    settle,
    window_key,
)

LIMITS = Limits(tpm=1000, rpm=10)


def test_admits_up_to_the_token_limit_and_says_when_to_retry() -> None:
    state = WindowState()
    assert reserve(state, "r1", 600, LIMITS, now=100.0).admitted
    refused = reserve(state, "r2", 500, LIMITS, now=115.5)
    assert not refused.admitted
    assert refused.reason == "tpm"
    assert refused.retry_after_s == 44.5  # r1's bucket (100.0-100.1 s) leaves at 160
    assert reserve(state, "r2", 500, LIMITS, now=160.0).admitted


def test_the_window_slides_second_by_second() -> None:
    state = WindowState()
    reserve(state, "a", 400, LIMITS, now=0.0)
    reserve(state, "b", 400, LIMITS, now=30.0)
    assert not reserve(state, "c", 400, LIMITS, now=59.9).admitted
    assert reserve(state, "c", 400, LIMITS, now=60.0).admitted  # "a" slid out
    assert not reserve(state, "d", 400, LIMITS, now=60.0).admitted


def test_rpm_limits_requests_independently_of_tokens() -> None:
    state = WindowState()
    for i in range(10):
        assert reserve(state, f"r{i}", 1, LIMITS, now=float(i)).admitted
    refused = reserve(state, "r10", 1, LIMITS, now=10.0)
    assert not refused.admitted and refused.reason == "rpm"
    assert refused.retry_after_s == 50.0


def test_settle_refunds_unused_tokens_and_charges_overruns() -> None:
    state = WindowState()
    reserve(state, "a", 900, LIMITS, now=0.0)
    assert settle(state, "a", 300, now=1.0) == -600
    assert reserve(state, "b", 700, LIMITS, now=2.0).admitted
    assert settle(state, "b", 750, now=3.0) == 50
    assert state.used() == (1050, 2)
    assert settle(state, "b", 750, now=4.0) is None  # settled once only


def test_a_redelivered_request_is_not_charged_twice() -> None:
    state = WindowState()
    reserve(state, "a", 900, LIMITS, now=0.0)
    again = reserve(state, "a", 900, LIMITS, now=1.0)
    assert again.admitted and not again.duplicate  # may not have run yet: run it
    assert state.used() == (900, 1)
    settle(state, "a", 500, now=2.0)
    after_settle = reserve(state, "a", 900, LIMITS, now=3.0)
    assert after_settle.admitted and after_settle.duplicate  # it ran: do not run it again
    assert state.used() == (500, 1)


def test_release_returns_a_request_that_never_ran() -> None:
    state = WindowState()
    reserve(state, "a", 900, LIMITS, now=0.0)
    release(state, "a", now=1.0)
    assert state.used() == (0, 0)


def test_a_request_larger_than_the_limit_is_refused_with_a_reason() -> None:
    decision = reserve(WindowState(), "a", 1001, LIMITS, now=0.0)
    assert not decision.admitted and "more than the 1000 per minute" in decision.reason


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 300, allow_nan=False),
            st.integers(1, 400),
            st.sampled_from(["reserve", "settle", "release"]),
            st.integers(0, 400),
        ),
        max_size=200,
    )
)
def test_the_sums_are_always_what_the_reservations_make(
    steps: list[tuple[float, int, str, int]],
) -> None:
    # What a restarted job rebuilds from the reservations alone is the state it had.
    state, ids = WindowState(), list[str]()
    for i, (at, num_tokens, action, actual) in enumerate(sorted(steps)):
        if action == "reserve" or not ids:
            ids.append(f"r{i}")
            reserve(state, ids[-1], num_tokens, LIMITS, now=at)
        elif action == "settle":
            settle(state, ids[num_tokens % len(ids)], actual, now=at)
        else:
            release(state, ids[num_tokens % len(ids)], now=at)
        rebuilt = WindowState.of(Reservations(dict(state.reservations.items())))
        rebuilt.expire(at)
        state.expire(at)
        assert rebuilt.buckets == {k: v for k, v in state.buckets.items() if v != [0, 0]}
        assert rebuilt.used() == state.used()
        # The totals kept as the buckets change are the buckets' sums.
        assert state.used() == (
            sum(tokens for tokens, _ in state.buckets.values()),
            sum(requests for _, requests in state.buckets.values()),
        )


requests = st.lists(
    st.tuples(st.floats(0, 300, allow_nan=False), st.integers(1, 400), st.integers(0, 400)),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(requests)
def test_no_sixty_second_window_ever_holds_more_than_the_limit(
    events: list[tuple[float, int, int]],
) -> None:
    """Whatever arrives, settled real counts in any window stay within tpm + overruns."""
    state = WindowState()
    admitted: list[tuple[float, int]] = []  # (bucket start, tokens charged)
    for i, (at, estimate, actual) in enumerate(sorted(events)):
        decision = reserve(state, f"r{i}", estimate, LIMITS, now=at)
        if decision.admitted:
            start = int(at * 10) / 10
            admitted.append((start, estimate))
            if actual <= estimate:  # refunds only: the limit must hold exactly
                settle(state, f"r{i}", actual, now=at)
                admitted[-1] = (start, actual)
        tokens, reqs = state.used()
        assert tokens <= LIMITS.tpm and reqs <= LIMITS.rpm
    for start, _ in admitted:
        in_window = [t for s, t in admitted if start <= s < start + 60]
        assert sum(in_window) <= LIMITS.tpm
        assert len(in_window) <= LIMITS.rpm


@settings(max_examples=100, deadline=None)
@given(requests)
def test_a_refused_request_fits_once_retry_after_has_passed(
    events: list[tuple[float, int, int]],
) -> None:
    state = WindowState()
    for i, (at, estimate, _) in enumerate(sorted(events)):
        decision = reserve(state, f"r{i}", estimate, LIMITS, now=at)
        if not decision.admitted:
            probe = WindowState.of(Reservations(dict(state.reservations.items())))
            later = at + decision.retry_after_s
            assert reserve(probe, "probe", estimate, LIMITS, now=later).admitted


SMOOTH = Limits(tpm=600, rpm=100, burst_s=10)  # at most 100 tokens in any 10 s


def test_smoothing_spreads_the_minute_over_its_short_windows() -> None:
    state = WindowState()
    assert reserve(state, "a", 60, SMOOTH, now=0.0).admitted
    refused = reserve(state, "b", 50, SMOOTH, now=1.0)
    assert not refused.admitted and refused.reason.startswith("tpm_burst")
    assert "100 tokens in any 10 s" in refused.reason
    assert refused.retry_after_s == 9.0  # "a"'s bucket (0.0-0.1 s) leaves the 10 s at 10.0
    assert not reserve(state, "b", 50, SMOOTH, now=9.9).admitted
    assert reserve(state, "b", 50, SMOOTH, now=10.0).admitted


def test_without_smoothing_the_whole_minute_may_go_at_once() -> None:
    state = WindowState()
    flat = Limits(tpm=600, rpm=100)
    assert all(reserve(state, f"r{i}", 100, flat, now=0.0).admitted for i in range(6))
    assert not reserve(state, "r6", 1, flat, now=0.0).admitted


def test_a_request_larger_than_the_short_allowance_fits_an_empty_short_window() -> None:
    state = WindowState()
    assert reserve(state, "big", 300, SMOOTH, now=0.0).admitted
    assert not reserve(state, "small", 1, SMOOTH, now=5.0).admitted
    assert reserve(state, "small", 1, SMOOTH, now=10.0).admitted


def test_settling_a_smaller_count_frees_the_short_window_too() -> None:
    state = WindowState()
    reserve(state, "a", 90, SMOOTH, now=0.0)
    assert not reserve(state, "b", 50, SMOOTH, now=1.0).admitted
    settle(state, "a", 20, now=2.0)
    assert reserve(state, "b", 50, SMOOTH, now=2.0).admitted


@settings(max_examples=200, deadline=None)
@given(requests)
def test_smoothing_bounds_every_short_window_and_still_every_minute(
    events: list[tuple[float, int, int]],
) -> None:
    limits = Limits(tpm=1000, rpm=50, burst_s=6)  # 100 tokens in any 6 s
    state = WindowState()
    admitted: list[tuple[int, int]] = []  # (bucket, tokens charged)
    for i, (at, estimate, _) in enumerate(sorted(events)):
        if reserve(state, f"r{i}", estimate, limits, now=at).admitted:
            admitted.append((math.floor(at * 10 + 1e-6), estimate))
    for first, _ in admitted:
        short = [t for b, t in admitted if first <= b < first + 60]
        # Over the allowance only by a request that came into an empty short window.
        assert sum(short) <= limits.burst_allowance() or len(short) == 1
        assert sum(t for b, t in admitted if first <= b < first + 600) <= limits.tpm


@settings(max_examples=100, deadline=None)
@given(requests)
def test_a_request_refused_for_a_burst_fits_once_retry_after_has_passed(
    events: list[tuple[float, int, int]],
) -> None:
    state = WindowState()
    for i, (at, estimate, _) in enumerate(sorted(events)):
        decision = reserve(state, f"r{i}", estimate, SMOOTH, now=at)
        if not decision.admitted and decision.reason.startswith("tpm_burst"):
            probe = WindowState.of(Reservations(dict(state.reservations.items())))
            later = at + decision.retry_after_s
            after = reserve(probe, "probe", estimate, SMOOTH, now=later)
            assert after.admitted or not after.reason.startswith("tpm_burst")


def test_a_batch_line_has_the_tenant_s_batch_window_tenant_first() -> None:
    assert window_key("acme") == window_key("acme", None) == "acme"
    assert window_key("acme", "batch_01") == window_key("acme", "batch_02") == "acme/batch"
    assert window_key("acme", "b").startswith("acme")  # the tenant leads the key
    # No tenant id holds a "/", so no tenant's own window is another's batch window.
    assert re.fullmatch(TENANT_ID_PATTERN, "acme/batch") is None


def test_a_tenant_back_after_a_quiet_minute_forgets_its_last_minute_a_share_per_call() -> None:
    big = Limits(tpm=10**9, rpm=10**6)
    state = WindowState()
    for n in range(200):  # a busy minute
        reserve(state, f"old{n}", 10, big, now=n * 0.1)
    settle(state, "old5", 8, now=20.0)
    assert len(state.reservations) == 200
    assert reserve(state, "back", 10, big, now=100.0).admitted  # a quiet minute later
    assert len(state.reservations) == 200 - EXPIRE_PER_CALL + 1
    # What is not forgotten yet counts as gone: not a duplicate, nothing to settle.
    assert settle(state, "old150", 10, now=100.0) is None
    release(state, "old151", now=100.0)
    again = reserve(state, "old199", 10, big, now=100.0)
    assert again.admitted and not again.duplicate and again.num_requests_used == 2
    assert state.used() == (20, 2)
    for n in range(4):  # each later call forgets another share
        reserve(state, f"new{n}", 10, big, now=100.0 + n)
    assert set(state.reservations) == {"back", "old199", "new0", "new1", "new2", "new3"}
    assert list(state.reservations)[:2] == ["back", "old199"]  # in arrival order
