"""The chaos rows' TTFT figures (tests/load/steady.py): quantiles of the requests
submitted in a span, or in several spans pooled."""

from __future__ import annotations

from typing import Any

from tests.load.steady import SteadyLoad


def load_with(ttft: list[tuple[float, float, str]]) -> SteadyLoad:
    client: Any = None  # the figures read only what the load recorded
    load = SteadyLoad(client, ["t0"])
    load.ttft = ttft
    return load


def test_pooled_spans_take_the_samples_of_each_and_none_between() -> None:
    before = [(float(t), 0.1, "t0") for t in range(0, 100)]  # 100 samples of 100 ms
    during = [(float(t), 5.0, "t0") for t in range(100, 200)]  # the abuse: 5 s each
    after = [(float(t), 0.3, "t0") for t in range(200, 300)]  # 100 samples of 300 ms
    load = load_with(before + during + after)

    p50, p99 = load.ttft_quantiles_over([(0, 100), (200, 300)])
    assert (p50, p99) == (0.3, 0.3)  # 200 samples: the median is the 101st, an after one
    assert load.ttft_quantiles_over([(0, 100)]) == load.ttft_quantiles(0, 100) == (0.1, 0.1)
    assert load.ttft_quantiles(100, 200) == (5.0, 5.0)


def test_a_span_with_no_sample_has_no_quantiles() -> None:
    load = load_with([(1.0, 0.2, "t0")])

    p50, p99 = load.ttft_quantiles_over([(5, 6), (7, 8)])
    assert p50 != p50 and p99 != p99  # NaN
