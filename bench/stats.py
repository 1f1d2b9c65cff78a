"""Summaries of latency samples. Pure, stdlib only: both environments import it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (0 < q <= 100) of already sorted samples."""
    if not sorted_samples:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_samples)))
    return sorted_samples[min(rank, len(sorted_samples)) - 1]


def summarize(samples: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50/p90/p99/max/mean of ``samples`` times ``scale`` (1000 turns seconds into ms)."""
    ordered = sorted(x * scale for x in samples)
    if not ordered:
        return {"n": 0}
    return {
        "n": len(ordered),
        "p50": round(percentile(ordered, 50), 3),
        "p90": round(percentile(ordered, 90), 3),
        "p99": round(percentile(ordered, 99), 3),
        "max": round(ordered[-1], 3),
        "mean": round(sum(ordered) / len(ordered), 3),
    }


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """The median of ``values``, with their min and max: how a figure of several runs
    is reported."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 3) if denominator else math.nan


def added_ttft_ms(bus: dict[str, float], direct: dict[str, float]) -> dict[str, float]:
    """What the bus adds to the first token: each percentile of the bus arm's TTFT less
    the direct arm's median, the engine's typical answer in the same run.

    Not percentile less percentile: the direct arm's tail on two shared cores is a few
    stalls of the engine (its c=1 p99 was 350 to 400 ms in two of three runs on
    ``3c71dde``, against 10 ms in the third), and subtracting it made the added p99
    negative. Against the median, the engine's own stalls on the bus arm count as the
    bus's: the figure can only overstate what tokenbus adds, never hide it."""
    return {q: round(bus[q] - direct["p50"], 3) for q in ("p50", "p90", "p99", "max") if q in bus}
