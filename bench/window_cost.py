"""The quota window's own CPU per request, as a tenant's window fills (pure policy).

    .venvs/stream/bin/python -m bench.window_cost [--buckets 10 100 600] [--repeat 5]

A tenant that sends in every 100 ms step of the minute has 600 buckets in its window.
Each point first fills a window to ``buckets`` steps (10 requests a step), then times
what the job does with it per request, in the step after the last: ``reserve`` a new
request, and ``settle`` the one reserved ten requests before. CPU time of this process
(``time.process_time``), the median of ``--repeat`` runs with its spread. No broker,
no job: this is the policy's share of the job's CPU per request, the part that grows
with how busy a tenant is.
"""

from __future__ import annotations

import argparse
import statistics
import time

from stream_jobs.window import BUCKETS_PER_S, Limits, WindowState, reserve, settle

PER_STEP = 10
"""Requests per 100 ms step."""
LIMITS = Limits(tpm=10**12, rpm=10**9)
"""Never binding: every request is admitted, as a tenant within its quota is."""


def _filled(num_buckets: int, start: float) -> tuple[WindowState, float]:
    state, now = WindowState(), start
    for n in range(num_buckets * PER_STEP):
        now = start + (n // PER_STEP) / BUCKETS_PER_S
        reserve(state, f"fill{n}", 100, LIMITS, now)
    return state, now


def us_per_request(num_buckets: int, num_requests: int) -> float:
    """CPU µs per request (a reserve and, a step later, its settle) in a full window."""
    state, now = _filled(num_buckets, start=1_767_225_600.0)
    now += 1 / BUCKETS_PER_S  # the step after the last: the window keeps its size
    began = time.process_time()
    for n in range(num_requests):
        reserve(state, f"r{n}", 100, LIMITS, now)
        if n >= PER_STEP:
            settle(state, f"r{n - PER_STEP}", 60, now)
    return (time.process_time() - began) / num_requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets", type=int, nargs="+", default=[10, 100, 600])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("| buckets in the window | µs per request (reserve + settle), median | min..max |")
    print("|---|---|---|")
    for num_buckets in args.buckets:
        runs = [us_per_request(num_buckets, args.requests) for _ in range(args.repeat)]
        print(
            f"| {num_buckets} | {statistics.median(runs):.1f} | {min(runs):.1f}..{max(runs):.1f} |"
        )


if __name__ == "__main__":
    main()
