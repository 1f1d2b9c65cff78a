"""What an idle stack costs: each service's CPU, in cores, with no traffic at all.

    .venvs/stream/bin/python -m bench.idle [--seconds 40] [--profile] [--set FIELD=VALUE ...]

The whole development stack (``tokenbus_cli.stack.Stack``: the bundled broker, the Faust
job, one worker, billing, alerts, the batch runner, the bridge) on the tiny model, left
alone for ``--settle-s`` and then measured for ``--seconds`` from /proc, each service with
the processes under it. On the bundled broker every consumer polls with a fetch each
``fetch_max_wait_ms``, so this is the price of those waits; ``--set`` tries others.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.admission import print_profile
from bench.common import (
    add_settings_args,
    bench_settings,
    model_dir,
    parse_overrides,
    run_benchmark,
)
from bench.procstat import CpuMeter, descendants
from bench.profile import Profiler, top_frames
from bench.report import uptime_load
from tokenbus_cli.stack import Stack

PROFILED = ("stream_job", "worker-0", "billing", "bridge")
"""The services ``--profile`` samples with py-spy (tokenbus's own Python processes)."""


def cores(spent: Mapping[str, float], seconds: float) -> dict[str, float]:
    """CPU seconds each service spent over ``seconds``, as cores, and their total. A
    service whose process went away reads less than at the start: it counts nothing."""
    per_second = {name: max(0.0, cpu) / seconds for name, cpu in spent.items()}
    return {
        **{name: round(v, 3) for name, v in per_second.items()},
        "total": round(sum(per_second.values()), 3),
    }


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    settings = bench_settings(model_path=model_dir(), **parse_overrides(args.set))
    stack = Stack(settings, on_progress=lambda m: console.print(f"[dim]stack: {m}[/]"))
    try:
        await stack.start()
        await asyncio.sleep(args.settle_s)
        meter = CpuMeter(
            {s.name: [s.process.pid, *descendants(s.process.pid)] for s in stack.services}
        )
        profilers = {
            s.name: Profiler(s.process.pid, settings.home / "profiles" / f"{s.name}-idle.txt")
            for s in stack.services
            if args.profile and s.name in PROFILED
        }
        meter.start()
        started = time.monotonic()
        await asyncio.sleep(args.seconds)
        idle = cores(meter.delta(), time.monotonic() - started)
        profiles = {name: top_frames(p.stop(), num_frames=20) for name, p in profilers.items()}
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(settings.home, ignore_errors=True)
    return {
        "load_start": load_start,
        "load_end": uptime_load(),
        "seconds": args.seconds,
        "overrides": args.set,
        "fetch_waits_ms": {
            "request_path": settings.consumer_fetch_wait_ms,
            "background": settings.background_fetch_wait_ms,
            "job": settings.job_fetch_max_wait_ms,
        },
        "idle_cores": idle,
        **({"profiles": profiles} if profiles else {}),
    }


def render(result: dict[str, Any], console: Console) -> None:
    waits = result["fetch_waits_ms"]
    table = Table(title="idle stack: cores per service")
    table.add_column("service")
    table.add_column("cores", justify="right")
    for name, value in result["idle_cores"].items():
        table.add_row(name, f"{value:.3f}")
    console.print(table)
    for name, profile in (result.get("profiles") or {}).items():
        print_profile(profile, console, f"idle {name}")
    console.print(
        f"[dim]fetch waits: request path {waits['request_path']} ms, background "
        f"{waits['background']} ms, job {waits['job']} ms; load "
        f"{result['load_start']['load_1_5_15']} -> {result['load_end']['load_1_5_15']}[/]"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=40.0, help="measured")
    parser.add_argument("--settle-s", type=float, default=20.0, help="after start, not measured")
    parser.add_argument("--name", default="idle", help="result file name")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy the job, worker, billing and bridge"
    )
    add_settings_args(parser)
    run_benchmark(parser, argv, measure, render)


if __name__ == "__main__":
    main()
