from __future__ import annotations

import math

from bench.stats import added_ttft_ms, percentile, ratio, summarize


def test_nearest_rank_percentiles() -> None:
    samples = sorted(float(x) for x in range(1, 101))
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile(samples, 100) == 100.0
    assert percentile([7.0], 99) == 7.0


def test_summarize_scales_to_milliseconds() -> None:
    summary = summarize([0.001, 0.002, 0.003], scale=1000)
    assert summary["n"] == 3
    assert summary["p50"] == 2.0
    assert summary["max"] == 3.0
    assert summary["mean"] == 2.0


def test_empty_samples_and_zero_denominators() -> None:
    assert summarize([]) == {"n": 0}
    assert math.isnan(percentile([], 50))
    assert math.isnan(ratio(1.0, 0.0))
    assert ratio(3.0, 2.0) == 1.5


def test_added_ttft_is_each_bus_percentile_less_the_direct_median_and_keeps_the_max() -> None:
    bus = {"p50": 20.0, "p90": 30.0, "p99": 45.0, "max": 80.0}
    direct = {"p50": 5.0, "p90": 9.0, "p99": 300.0, "max": 400.0}
    assert added_ttft_ms(bus, direct) == {"p50": 15.0, "p90": 25.0, "p99": 40.0, "max": 75.0}
    # A summary without a max (an older run's) gives the percentiles alone.
    assert "max" not in added_ttft_ms({k: bus[k] for k in ("p50", "p90", "p99")}, direct)


def test_a_nearest_rank_p99_is_the_worst_of_96_samples_and_the_second_worst_of_192() -> None:
    """Why bench.overhead takes at least 64 requests a wave (192 over three rounds)."""
    assert percentile([float(i) for i in range(96)], 99) == 95.0  # the max
    assert percentile([float(i) for i in range(192)], 99) == 190.0  # the second worst
