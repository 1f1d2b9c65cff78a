from __future__ import annotations

from typing import Any

from bench.interference_runs import batch_backoff_s, table


def result(tokens: list[int], ratio: float, commit: str = "abc1234") -> dict[str, Any]:
    """A bench.batch_interference result: D from 10 s, the batch at 1,000 tokens/s alone."""
    wave = {"ttft_ms": {"p50": 40.0, "p99": 90.0}}
    return {
        "goals": [
            {
                "figure": "interactive TTFT p99 with/without batch, c=1",
                "goal": "<= 1.5",
                "value": ratio,
                "against_each_part": {"before": 2 * ratio, "after": ratio},
            }
        ],
        "phases": {"D_interactive_with_batch": [10.0, 20.0]},
        "batch_alone_tokens_per_s": 1000.0,
        "timeline": [{"t": 9.0 + n, "batch_tokens": t} for n, t in enumerate(tokens)],
        "pacer_first_backoff_s": 3.0,
        "interactive": {
            "alone_before": {"1": wave},
            "with_batch": {
                "1": {
                    **wave,
                    "first_ttft_ms": 120.4,
                    "learner": [[5.0, "probe"], [6.0, "probe failed"]],
                }
            },
            "alone_after": {"1": wave},
        },
        "load_start": {"load_1_5_15": [1.0, 1.0, 1.0]},
        "load_end": {"load_1_5_15": [2.0, 1.0, 1.0]},
        "machine": {"git": commit, "dirty": False},
    }


def test_the_batch_gave_the_engine_back_at_the_first_second_under_a_tenth_of_its_rate() -> None:
    # 9 s: before D (not counted); 10 s: 900; 11 s: 300; 12 s: 50 -> 2 s into D.
    assert batch_backoff_s(result([0, 900, 300, 50, 0], 1.0)) == 2.0
    assert batch_backoff_s(result([0, 900, 900], 1.0)) is None  # never in D


def test_the_table_gives_each_run_and_the_median_with_its_spread() -> None:
    text = table([result([0, 50], 1.2), result([0, 900, 20], 0.8), result([0, 0], 1.0, "def5678")])
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()}
    assert lines["interactive TTFT p99 with/without batch, c=1"].endswith(
        "| 1.2 | 0.8 | 1 | **1** (0.8..1.2) |"
    )
    assert "| 0 | 1 | 0 | **0** (0..1) |" in lines["seconds until the batch gave the engine back"]
    assert "| 2.4 | 1.6 | 2 |" in lines["c=1: against the baseline before only"]
    assert lines["seat learner in D at c=1: probes / failed / held"].count("1 / 1 / 0") == 3
    assert "`def5678`" in lines["commit"] and text.splitlines()[0].count("run ") == 3


def test_the_table_gives_the_stacks_cpu_per_batch_token_and_the_intervals() -> None:
    runs = [result([0], 1.0), result([0], 1.0), result([0], 1.0)]
    figures = [(300.0, 1700.0), (500.0, 2540.5), (400.0, 2130.0)]
    for run, (worker, everything) in zip(runs, figures, strict=True):
        run["parameters"] = {"stream_interval": 1, "batch_stream_interval": 16}
        run["cpu_us_per_batch_token_in_C"] = {"worker-0": worker, "all": everything}
    del runs[2]["parameters"]  # a run written before the field
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table(runs).splitlines()}
    assert "| 16 (1) | 16 (1) | - |" in lines["batch stream interval (worker's)"]
    assert lines["C: CPU µs per batch token, worker-0"].endswith(
        "| 300 | 500 | 400 | **400** (300..500) |"
    )
    assert lines["C: CPU µs per batch token, the stack"].endswith(
        "| 1,700 | 2,540 | 2,130 | **2,130** (1,700..2,540) |"
    )
    rows = [line.split(" | ")[0].lstrip("| ") for line in table(runs).splitlines()]
    assert rows.index("C: CPU µs per batch token, worker-0") < rows.index(
        "C: CPU µs per batch token, the stack"
    )
