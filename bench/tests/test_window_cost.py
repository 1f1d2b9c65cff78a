"""bench.window_cost times the policy against a window of the size it names."""

from __future__ import annotations

from bench.window_cost import PER_STEP, _filled, us_per_request


def test_a_filled_window_holds_the_buckets_asked_for() -> None:
    state, _ = _filled(37, start=1_767_225_600.0)
    assert len(state.buckets) == 37
    assert state.used() == (37 * PER_STEP * 100, 37 * PER_STEP)


def test_a_point_times_some_work() -> None:
    assert us_per_request(5, 200) > 0
