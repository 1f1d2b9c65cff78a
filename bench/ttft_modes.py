"""The shape of a concurrency's TTFT in ``bench.overhead`` results: a histogram, and the
legs and path spans of the requests below and above a split.

    .venvs/stream/bin/python -m bench.ttft_modes bench/results/overhead-*.json \\
        [--concurrency 1] [--split-ms 26] [--bin-ms 3]

At c=1 the bus arm's TTFT has two modes on the bundled broker (bench/JOURNAL.md,
"What changed on 2026-12-06 (after midnight)"): this prints, for each result file, how many
requests fall in each and where the slower ones spend the difference. A diagnostic that
reads the files ``bench.overhead`` wrote (``requests_ms``), not a benchmark of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench.overhead import LEGS


def histogram(ttfts: list[float], bin_ms: float) -> dict[float, int]:
    """Requests per ``bin_ms``-wide bin of TTFT, keyed by each bin's lower edge."""
    counts = Counter(bin_ms * int(t // bin_ms) for t in ttfts)
    return dict(sorted(counts.items()))


def modes(requests: list[dict[str, Any]], split_ms: float) -> dict[str, dict[str, Any]]:
    """The requests below ``split_ms`` of TTFT ("fast") and at or above it ("slow"): how
    many, and the median of each leg and each path span over them (a span only over the
    requests that have it). Pure."""
    out: dict[str, dict[str, Any]] = {}
    for name, group in (
        ("fast", [r for r in requests if r["ttft"] < split_ms]),
        ("slow", [r for r in requests if r["ttft"] >= split_ms]),
    ):
        if not group:
            continue
        spans: dict[str, list[float]] = {}
        for request in group:
            for span, ms in request.get("spans", {}).items():
                spans.setdefault(span, []).append(ms)
        out[name] = {
            "requests": len(group),
            "ttft": round(statistics.median(r["ttft"] for r in group), 2),
            **{leg: round(statistics.median(r[leg] for r in group), 2) for leg in LEGS},
            "spans": {span: round(statistics.median(v), 2) for span, v in sorted(spans.items())},
        }
    return out


def positive_ms(text: str) -> float:
    """A histogram's bin width: a number of ms above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{value} ms is not a width above 0")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--split-ms", type=float, default=26.0)
    parser.add_argument("--bin-ms", type=positive_ms, default=3.0)
    args = parser.parse_args(argv)
    for path in args.results:
        try:
            result = json.loads(path.read_text())
            rows = [r for r in result["results"] if r.get("concurrency") == args.concurrency]
            load = result["load_start"]["load_1_5_15"][0]
            commit = result["machine"]["git"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            print(f"{path}: not a bench.overhead result ({type(exc).__name__}: {exc})")
            continue
        if not rows or "requests_ms" not in rows[0]:
            print(f"{path}: no requests at c={args.concurrency} (or written before requests_ms)")
            continue
        requests = rows[0]["requests_ms"]
        print(f"{path.name} ({commit}, load {load}): {len(requests)} requests")
        bins = histogram([r["ttft"] for r in requests], args.bin_ms)
        print("  TTFT ms: " + ", ".join(f"{edge:g}+: {n}" for edge, n in bins.items()))
        for name, mode in modes(requests, args.split_ms).items():
            spans = mode.pop("spans")
            print(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in mode.items()))
            print("    spans: " + ", ".join(f"{k} {v}" for k, v in spans.items()))


if __name__ == "__main__":
    main()
