"""Several runs of ``bench.batch_interference`` side by side, as BENCHMARKS.md's section 7
shows them: each goal per run with its median and spread, the TTFTs behind the ratios,
what the worker's seat learner did, how fast the batch gave the engine back, and each
run's load and commit.

    .venvs/stream/bin/python -m bench.interference_runs bench/results/bi-tier-2026*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BATCH_GONE_BELOW = 0.1
"""The batch has given the engine back once its tokens/s is under this share of its rate
alone."""


def batch_backoff_s(result: dict[str, Any]) -> float | None:
    """Seconds from D's start (the first interactive wave beside the batch) to the first
    timeline second whose batch tokens are under ``BATCH_GONE_BELOW`` of the rate alone;
    None if that never came in D."""
    start, end = (float(x) for x in result["phases"]["D_interactive_with_batch"])
    floor = BATCH_GONE_BELOW * result["batch_alone_tokens_per_s"]
    for second in result["timeline"]:
        if start <= second["t"] <= end and second["batch_tokens"] < floor:
            return round(max(0.0, float(second["t"]) - start), 1)
    return None


def _number(value: float) -> str:
    """Three significant digits, and whole numbers with separators from 1,000 up."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _spread(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return ""
    median, low, high = (_number(v) for v in (statistics.median(known), min(known), max(known)))
    return f"**{median}** ({low}..{high})"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return _number(value) if isinstance(value, float) else str(value)


def _learner(result: dict[str, Any], concurrency: str) -> str:
    wave = result["interactive"]["with_batch"].get(concurrency, {})
    if "learner" not in wave:
        return "not recorded"
    steps = [what for _, what in wave["learner"]]
    return " / ".join(str(steps.count(s)) for s in ("probe", "probe failed", "probe held"))


def table(results: Sequence[dict[str, Any]]) -> str:
    concurrencies = sorted({c for r in results for c in r["interactive"]["with_batch"]}, key=int)
    rows: list[str] = []

    def figure(name: str, goal: str, values: list[Any], spread: bool = True) -> None:
        cells = " | ".join(_cell(v) for v in values)
        rows.append(f"| {name} | {goal} | {cells} | {_spread(values) if spread else ''} |")

    for goal in results[0]["goals"]:
        name = goal["figure"]
        values = [
            next((g["value"] for g in r["goals"] if g["figure"] == name), None) for r in results
        ]
        figure(name, goal["goal"], values)
    figure(
        "seconds until the batch gave the engine back", "-", [batch_backoff_s(r) for r in results]
    )
    figure(
        "pacer's first back-off, s into D", "-", [r.get("pacer_first_backoff_s") for r in results]
    )
    for c in concurrencies:
        for part in ("before", "after"):
            figure(
                f"c={c}: against the baseline {part} only",
                "-",
                [
                    next(
                        (
                            (g.get("against_each_part") or {}).get(part)
                            for g in r["goals"]
                            if g["figure"].endswith(f"c={c}")
                        ),
                        None,
                    )
                    for r in results
                ],
            )
        for key, label in (
            ("alone_before", "before"),
            ("with_batch", "with batch"),
            ("alone_after", "after"),
        ):
            cells = []
            for r in results:
                ttft = r["interactive"][key].get(c, {}).get("ttft_ms")
                cells.append(f"{ttft['p50']:.0f} / {ttft['p99']:.0f}" if ttft else None)
            figure(f"c={c} TTFT p50 / p99 ms, {label}", "-", cells, spread=False)
    figure(
        "c=1 first request beside the batch, ms",
        "-",
        [
            round(r["interactive"]["with_batch"].get("1", {}).get("first_ttft_ms") or 0)
            for r in results
        ],
        spread=False,
    )
    for c in concurrencies:
        figure(
            f"seat learner in D at c={c}: probes / failed / held",
            "-",
            [_learner(r, c) for r in results],
            spread=False,
        )
    figure(
        "batch stream interval (worker's)",
        "-",
        [
            "{batch_stream_interval} ({stream_interval})".format(**r["parameters"])
            if "batch_stream_interval" in r.get("parameters", {})
            else None
            for r in results
        ],
        spread=False,
    )
    per_token = [r.get("cpu_us_per_batch_token_in_C") or {} for r in results]
    for name in sorted({k for p in per_token for k in p}, key=lambda k: (k == "all", k)):
        figure(
            f"C: CPU µs per batch token, {'the stack' if name == 'all' else name}",
            "-",
            [p.get(name) for p in per_token],
        )
    figure(
        "load (1 min) at start → end",
        "-",
        [
            f"{r['load_start']['load_1_5_15'][0]} → {r['load_end']['load_1_5_15'][0]}"
            for r in results
        ],
        spread=False,
    )
    figure(
        "commit",
        "-",
        [f"`{r['machine']['git']}`" + (" dirty" if r["machine"]["dirty"] else "") for r in results],
        spread=False,
    )
    header = "| figure | goal | " + " | ".join(f"run {i + 1}" for i in range(len(results)))
    return "\n".join([header + " | median (min..max) |", "|" + "---|" * (len(results) + 3), *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="bench.batch_interference results")
    args = parser.parse_args()
    print(table([json.loads(path.read_text()) for path in args.results]))


if __name__ == "__main__":
    main()
