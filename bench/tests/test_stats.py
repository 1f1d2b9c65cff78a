from __future__ import annotations

import math

from bench.stats import percentile, ratio, summarize


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
