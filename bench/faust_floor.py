"""How much of the job's CPU per request is Faust's: the admission goal against its floor.

    .venvs/stream/bin/python -m bench.faust_floor [--requests 5000] [--repeat 3] [--profile]

Runs ``bench.admission``'s burst (the same records, tenants, broker and pretend worker)
against five admitters in turn, each on a stack of its own, ``--repeat`` times:

- ``forward``: a Faust agent that forwards each record unread and acks it once the
  broker has it (``bench.faust_floor_app``), on the job's own Faust configuration;
- ``ledger``: that, and one changelog-backed table write per request, as the job's
  request ledger writes;
- ``aiokafka_forward`` and ``aiokafka_ledger``: the same two without Faust, a plain
  aiokafka consumer and producer a batch at a time (``bench.aiokafka_floor_app``), as a
  batched admit path around Faust would have them;
- ``job``: the Faust job itself (``python -m stream_jobs``).

Each figure is CPU µs per request of the admitting process (all its threads, from
``/proc``), the median of the repeats with its min..max; the floor's share of the job
is taken within each repeat, then its median. Whatever the dispatcher did in no time at
all, the job could not use less CPU per request than the ``ledger`` floor: that floor
against issue 17's 200 µs says what a per-event Faust agent can reach on this machine.

``--profile`` runs py-spy on each admitter during its bursts and prints, per arm, the
frames of its repeats pooled (``bench.profile``): where Faust's floor goes. py-spy slows
the process it samples, so a profiled run's result is ``faust_floor-profile``, which
the goals table does not take.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import stats
from bench.admission import JobStarter, print_profile, run_admission
from bench.common import (
    add_settings_args,
    parse_overrides,
    profiled_name,
    progress,
    progress_task,
    run_benchmark,
)
from bench.profile import merge_raw, top_frames
from bench.report import RESULTS_DIR, uptime_load
from tokenbus_cli.stack import Stack, free_port

GOAL_US = 200.0
"""Issue 17's admission goal: 5,000 requests/s per job core."""
ARMS = ("forward", "ledger", "aiokafka_forward", "aiokafka_ledger", "job")


def floor_job(mode: str) -> JobStarter:
    """Starts ``bench.faust_floor_app`` (or ``bench.aiokafka_floor_app``) in ``mode`` as
    ``stream_job``; ready once it forwards (``run_admission`` probes it)."""

    async def start(stack: Stack, forward_to: str) -> None:
        env = {"BENCH_FLOOR_MODE": mode, "BENCH_FLOOR_TO": forward_to}
        if mode.startswith("aiokafka"):
            stack.spawn(
                "stream_job", [sys.executable, "-m", "bench.aiokafka_floor_app"], env_extra=env
            )
            return
        stack.spawn(
            "stream_job",
            [sys.executable, "-m", "bench.faust_floor_app"],
            env_extra=env,
            faust_web_port=free_port(),
            faust_datadir=stack.settings.home / "faust-floor",
        )

    return start


def us_per_request(row: dict[str, Any]) -> float:
    return float(1e6 * row["cpu_s"]["stream_job"] / max(1, row["num_forwarded"]))


def spread(values: list[float]) -> dict[str, float]:
    """The median of ``values``, with their min and max, to a tenth."""
    return stats.spread(values, digits=1)


def shares(runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each floor's share of the job's CPU per request, taken within each repeat."""
    return {
        arm: spread([100 * f / j for f, j in zip(runs[arm], runs["job"], strict=True)])
        for arm in runs
        if arm != "job"
    }


def _after(advance: Callable[[int], None], base: int) -> Callable[[int], None]:
    """``advance`` of a run that starts ``base`` requests into the whole."""
    return lambda n: advance(base + n)


async def _main(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    rows: list[dict[str, Any]] = []
    runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
    raw: dict[str, list[Path]] = {arm: [] for arm in ARMS}
    with progress(console) as bar:
        advance = progress_task(bar, "faust floor", args.repeat * len(ARMS) * args.requests)
        done = 0
        for repeat in range(args.repeat):
            for arm in ARMS:
                profile_to = (
                    RESULTS_DIR / f"faust_floor-{arm}-{repeat}.pyspy.txt" if args.profile else None
                )
                if profile_to is not None:
                    raw[arm].append(profile_to)
                row = await run_admission(
                    num_requests=args.requests,
                    overrides=parse_overrides(args.set),
                    num_latency_probes=10,
                    on_progress=_after(advance, done),
                    job=None if arm == "job" else floor_job(arm),
                    profile_to=profile_to,
                )
                row.pop("profile", None)  # pooled below, per arm
                done += args.requests
                row = {"arm": arm, "repeat": repeat, **row}
                rows.append(row)
                runs[arm].append(us_per_request(row))
    return {
        "load_start": load_start,
        "load_end": uptime_load(),
        "goal_us_per_request": GOAL_US,
        "us_per_request": {arm: spread(values) for arm, values in runs.items()},
        "share_of_job_pct": shares(runs),
        "results": rows,
        **({"profiles": pooled_profiles(raw, RESULTS_DIR)} if args.profile else {}),
    }


def pooled_profiles(raw: dict[str, list[Path]], into: Path) -> dict[str, dict[str, Any]]:
    """Each arm's py-spy files, its repeats' samples pooled (``into``, a file per arm):
    ``top_frames`` per arm."""
    return {
        arm: top_frames(merge_raw(parts, into / f"faust_floor-{arm}.pyspy.txt"))
        for arm, parts in raw.items()
        if parts
    }


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title="admitting process: CPU µs per request (median, min..max)")
    for column in ("admitter", "µs/request", "requests/s per core", "share of the job"):
        table.add_column(column, justify="right")
    share = result["share_of_job_pct"]
    for arm, cost in result["us_per_request"].items():
        table.add_row(
            arm,
            f"{cost['median']:.0f} ({cost['min']:.0f}..{cost['max']:.0f})",
            f"{1e6 / cost['median']:,.0f}",
            f"{share[arm]['median']:.0f}% ({share[arm]['min']:.0f}..{share[arm]['max']:.0f})"
            if arm in share
            else "-",
        )
    console.print(table)
    console.print(f"goal: ≤ {result['goal_us_per_request']:.0f} µs per request")
    for arm, profile in (result.get("profiles") or {}).items():
        print_profile(profile, console, arm)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--profile", action="store_true", help="py-spy each admitter (slows it; not a figure)"
    )
    parser.add_argument("--name", help="result file name (default: faust_floor, or -profile)")
    add_settings_args(parser)
    run_benchmark(parser, None, _main, render, profiled_name("faust_floor"))


if __name__ == "__main__":
    main()
