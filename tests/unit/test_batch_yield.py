"""The batch yield (tokenbus.batch_yield): class 2 held to a cap while interactive runs."""

from __future__ import annotations

import pytest

from tokenbus.batch_yield import (
    BatchYield,
    YieldPolicy,
    create_batch_yield,
    num_yielding,
)

POLICY = YieldPolicy(seats_per_worker=4, hold_s=3.0)


def test_no_cap_until_interactive_traffic_is_seen() -> None:
    batch_yield = BatchYield(POLICY)
    assert batch_yield.batch_cap("m", 10.0, num_workers=2, num_interactive_in_flight=0) is None


def test_the_first_interactive_request_caps_class_2_per_live_worker_of_its_model() -> None:
    batch_yield = BatchYield(POLICY)
    batch_yield.note_interactive("m", 10.0)
    assert batch_yield.batch_cap("m", 10.0, num_workers=2, num_interactive_in_flight=0) == 8
    assert batch_yield.batch_cap("m", 10.0, num_workers=1, num_interactive_in_flight=0) == 4
    # Another model's engines are not this traffic's: no cap there.
    assert batch_yield.batch_cap("n", 10.0, num_workers=2, num_interactive_in_flight=0) is None


def test_the_cap_holds_for_hold_s_after_the_last_arrival_then_lifts() -> None:
    batch_yield = BatchYield(POLICY)
    batch_yield.note_interactive("m", 10.0)
    batch_yield.note_interactive("m", 12.0)
    assert batch_yield.is_yielding("m", 14.9, num_interactive_in_flight=0)
    assert not batch_yield.is_yielding("m", 15.0, num_interactive_in_flight=0)
    assert batch_yield.batch_cap("m", 15.0, num_workers=1, num_interactive_in_flight=0) is None


def test_the_cap_holds_while_an_interactive_request_still_runs() -> None:
    batch_yield = BatchYield(POLICY)
    batch_yield.note_interactive("m", 10.0)
    assert batch_yield.batch_cap("m", 60.0, num_workers=1, num_interactive_in_flight=1) == 4
    assert batch_yield.batch_cap("m", 60.0, num_workers=1, num_interactive_in_flight=0) is None


def test_a_cap_of_zero_stops_class_2_while_interactive_runs() -> None:
    batch_yield = BatchYield(YieldPolicy(seats_per_worker=0, hold_s=1.0))
    batch_yield.note_interactive("m", 0.0)
    assert batch_yield.batch_cap("m", 0.5, num_workers=3, num_interactive_in_flight=0) == 0


def test_a_cap_above_the_seats_never_binds() -> None:
    batch_yield = create_batch_yield(1000, 3.0)
    batch_yield.note_interactive("m", 10.0)
    cap = batch_yield.batch_cap("m", 10.0, num_workers=1, num_interactive_in_flight=5)
    assert cap == 1000 and num_yielding(64, cap) == 0


def test_lines_above_the_cap_are_the_ones_interactive_does_not_wait_for() -> None:
    assert num_yielding(44, None) == 0
    assert num_yielding(44, 4) == 40
    assert num_yielding(3, 4) == 0


@pytest.mark.parametrize(("seats", "hold_s"), [(-1, 1.0), (1, -0.5)])
def test_a_negative_setting_is_refused(seats: int, hold_s: float) -> None:
    with pytest.raises(ValueError, match="seats_per_worker >= 0"):
        YieldPolicy(seats_per_worker=seats, hold_s=hold_s)
