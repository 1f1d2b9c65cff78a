"""The shared cost weight: context length, precision and peak hour, at each boundary."""

import itertools
from datetime import UTC, datetime, timedelta, timezone

import pytest

from tokenbus.cost import (
    NO_PEAK_HOURS,
    PeakHours,
    context_factor,
    cost_weight,
    precision_factor,
)

OFF_PEAK = datetime(2026, 3, 2, 3, 0, tzinfo=UTC)
NINE_TO_FIVE = PeakHours.parse("9-17")


@pytest.mark.parametrize(
    ("num_prompt_tokens", "factor"),
    [
        (0, 1.0),
        (1, 1.0),
        (2047, 1.0),  # below 2k
        (2048, 1.2),  # 2k
        (4095, 1.2),
        (4096, 1.3),  # 4k: one further 2k
        (6143, 1.3),
        (6144, 1.4),
        (8192, 1.5),
        (10_240, 1.6),
        (16_383, 1.8),
        (16_384, 1.9),
        (131_072, 1.2 + 0.1 * 63),
    ],
)
def test_the_context_factor_steps_every_2k(num_prompt_tokens: int, factor: float) -> None:
    assert context_factor(num_prompt_tokens) == pytest.approx(factor, abs=1e-12)
    assert cost_weight(num_prompt_tokens, "fp16", OFF_PEAK) == round(factor, 6)


def test_every_context_step_adds_exactly_a_tenth() -> None:
    weights = [cost_weight(step * 2048, "fp32", OFF_PEAK) for step in range(1, 40)]
    assert weights[0] == 1.2
    # Exact decimal steps: no drift such as 1.7000000000000002 however long the prompt.
    assert all(round(b - a, 6) == 0.1 for a, b in itertools.pairwise(weights))
    assert all(w == round(w, 1) for w in weights)


def test_a_negative_count_is_treated_as_empty() -> None:
    assert context_factor(-5) == 1.0


@pytest.mark.parametrize(
    ("precision", "factor"),
    [("int8", 0.7), ("INT8", 0.7), ("fp16", 1.0), ("bf16", 1.0), ("fp32", 1.0), ("", 1.0)],
)
def test_int8_costs_less(precision: str, factor: float) -> None:
    assert precision_factor(precision) == factor


def test_the_factors_multiply() -> None:
    peak = datetime(2026, 3, 2, 10, 30, tzinfo=UTC)

    assert cost_weight(100, "fp16", peak, NINE_TO_FIVE) == 1.5
    assert cost_weight(100, "int8", peak, NINE_TO_FIVE) == 1.05
    assert cost_weight(8192, "int8", OFF_PEAK, NINE_TO_FIVE) == 1.05
    assert cost_weight(8192, "int8", peak, NINE_TO_FIVE) == 1.575
    assert cost_weight(2048, "fp32", peak, NINE_TO_FIVE) == 1.8
    assert cost_weight(100, "fp16", peak) == 1.0  # no peak hours configured


def test_peak_hours_are_half_open_and_read_in_their_zone() -> None:
    at = datetime(2026, 3, 2, tzinfo=UTC)
    assert not NINE_TO_FIVE.contains(at.replace(hour=8, minute=59))
    assert NINE_TO_FIVE.contains(at.replace(hour=9))
    assert NINE_TO_FIVE.contains(at.replace(hour=16, minute=59))
    assert not NINE_TO_FIVE.contains(at.replace(hour=17))

    berlin = PeakHours.parse("9-17", tz="Europe/Berlin")  # UTC+1 in March
    assert berlin.contains(at.replace(hour=8))
    assert not berlin.contains(at.replace(hour=16))
    # Another offset on the instant changes nothing: the zone of the rule decides.
    assert NINE_TO_FIVE.contains(datetime(2026, 3, 2, 12, tzinfo=timezone(timedelta(hours=2))))
    # A naive instant is UTC, as everywhere on the bus.
    assert NINE_TO_FIVE.contains(datetime(2026, 3, 2, 9))


def test_peak_hour_specs() -> None:
    assert PeakHours.parse("9-17").hours == frozenset(range(9, 17))
    assert PeakHours.parse("8-10, 14-15").hours == frozenset({8, 9, 14})
    assert PeakHours.parse("22-2").hours == frozenset({22, 23, 0, 1})
    assert PeakHours.parse("0-24").hours == frozenset(range(24))
    assert PeakHours.parse("") == NO_PEAK_HOURS
    assert not NO_PEAK_HOURS.contains(datetime(2026, 3, 2, 12, tzinfo=UTC))


@pytest.mark.parametrize("spec", ["9", "9-9", "x-5", "25-3", "-1-4", "9-17-3"])
def test_bad_peak_hour_specs_fail_at_parse(spec: str) -> None:
    with pytest.raises(ValueError, match="peak hours span"):
        PeakHours.parse(spec)


def test_an_unknown_zone_fails_at_parse() -> None:
    with pytest.raises(Exception, match="No time zone"):
        PeakHours.parse("9-17", tz="Mars/Olympus")
