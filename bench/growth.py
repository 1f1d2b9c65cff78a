"""Growth: how each stage's cost grows with tenants, workers and prompt length.

    .venvs/stream/bin/python -m bench.growth [--stages admission relay billing bridge]

- admission (Faust job, pretend workers): tenants 10 -> 1,000; workers 1 -> 4;
  prompt 100 -> 8k tokens;
- relay (worker loop on the pretend engine -> client): tenants 10 -> 1,000; workers
  1 -> 4; prompt 100 -> 8k tokens (the prompt rides in the request to the worker);
- billing ingest: tenants 10 -> 1,000;
- the SSE bridge (HTTP clients, the job, pretend workers): tenants 10 -> 1,000; workers
  1 -> 4; prompt 100 -> 8k tokens.

Cost is CPU per unit of work (ms per request, µs per token, µs per event), which the
noisy shared machine disturbs far less than wall-clock rates; both are recorded.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from rich.console import Console
from rich.progress import TaskID
from rich.table import Table

from bench.admission import run_admission
from bench.billing_ingest import run_ingest
from bench.bridge import run_bridge
from bench.common import exit_on_sigterm, make_console, progress
from bench.relay import run_relay
from bench.report import uptime_load, write_result

TENANTS = (10, 100, 1_000)
WORKERS = (1, 2, 4)
PROMPT_TOKENS = (100, 1_000, 8_000)


def plan(
    args: argparse.Namespace,
) -> list[tuple[str, str, int, Callable[[], Awaitable[dict[str, Any]]]]]:
    """(stage, axis, value, run) for every point of the sweep."""
    points: list[tuple[str, str, int, Callable[[], Awaitable[dict[str, Any]]]]] = []
    if "admission" in args.stages:
        n = args.requests
        for t in TENANTS:
            points.append(
                (
                    "admission",
                    "tenants",
                    t,
                    partial(run_admission, num_requests=n, num_tenants=t),
                )
            )
        for w in WORKERS:
            points.append(
                (
                    "admission",
                    "workers",
                    w,
                    partial(run_admission, num_requests=n, num_workers=w),
                )
            )
        for p in PROMPT_TOKENS:
            points.append(
                (
                    "admission",
                    "prompt_tokens",
                    p,
                    partial(run_admission, num_requests=n, prompt_tokens=p),
                )
            )
    if "relay" in args.stages:
        for t in (10, 1_000):
            points.append(
                ("relay", "tenants", t, partial(run_relay, num_requests=128, num_tenants=t))
            )
        for w in WORKERS:
            points.append(
                ("relay", "workers", w, partial(run_relay, num_requests=128, num_workers=w))
            )
        for p in PROMPT_TOKENS:
            points.append(
                (
                    "relay",
                    "prompt_tokens",
                    p,
                    partial(run_relay, num_requests=128, prompt_tokens=p),
                )
            )
    if "billing" in args.stages:
        for t in TENANTS:
            points.append(
                (
                    "billing",
                    "tenants",
                    t,
                    partial(run_ingest, num_events=args.events, num_tenants=t),
                )
            )
    if "bridge" in args.stages:
        bridge = partial(run_bridge, num_requests=64, max_tokens=256, concurrency=16)
        for t in (10, 1_000):
            points.append(("bridge", "tenants", t, partial(bridge, num_tenants=t)))
        for w in WORKERS:
            points.append(("bridge", "workers", w, partial(bridge, num_workers=w)))
        for p in PROMPT_TOKENS:
            points.append(("bridge", "prompt_tokens", p, partial(bridge, prompt_tokens=p)))
    return points


PER_TOKEN: dict[str, tuple[str, dict[str, str]]] = {
    # stage: (its per-core figure, {column: its process in us_per_token})
    "relay": (
        "tokens_per_core_s",
        {"worker_us": "worker_loop", "broker_us": "broker", "client_us": "client"},
    ),
    "bridge": (
        "bridge_tokens_per_core_s",
        {
            "bridge_us": "bridge",
            "job_us": "stream_job",
            "workers_us": "workers",
            "broker_us": "broker",
        },
    ),
}


def cost(stage: str, row: dict[str, Any]) -> dict[str, Any]:
    """The per-unit figures the growth table compares."""
    if stage == "admission":
        n = max(1, row["num_forwarded"])
        return {
            "unit": "request",
            "rate": row["requests_per_s"],
            "per_core": row["requests_per_core_s"],
            "job_cpu_ms": round(1000 * row["cpu_s"]["stream_job"] / n, 3),
            "broker_cpu_ms": round(1000 * row["cpu_s"]["broker"] / n, 3),
        }
    if stage in PER_TOKEN:
        per_core, parts = PER_TOKEN[stage]
        us = row["us_per_token"]
        return {
            "unit": "token",
            "rate": row["tokens_per_s"],
            "per_core": row[per_core],
            **{label: us[key] for label, key in parts.items()},
        }
    return {
        "unit": "event",
        "rate": row["events_per_s"],
        "per_core": row["events_per_core_s"],
        "sink_cpu_us": round(1e6 / max(1e-9, row["events_per_core_s"]), 2),
    }


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    points = plan(args)
    rows: list[dict[str, Any]] = []
    with progress(console) as bar:
        task: TaskID = bar.add_task("growth sweep", total=len(points))
        for stage, axis, value, run in points:
            bar.update(task, description=f"{stage}: {axis}={value}")
            row = await run()
            row.pop("profile", None)
            rows.append(
                {
                    "stage": stage,
                    "axis": axis,
                    "value": value,
                    "cost": cost(stage, row),
                    "raw": row,
                    "load": uptime_load(),
                }
            )
            bar.advance(task)
    return {
        "command": "python -m bench.growth " + " ".join(args.argv),
        "load_start": load_start,
        "load_end": uptime_load(),
        "results": rows,
    }


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title="growth: cost per unit of work as the workload grows")
    for column in (
        "stage",
        "axis",
        "value",
        "rate /s",
        "per core /s",
        "CPU per unit (by process)",
        "load 1m",
    ):
        table.add_column(column, justify="right")
    for row in result["results"]:
        c = row["cost"]
        parts = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("unit", "rate", "per_core"))
        table.add_row(
            row["stage"],
            row["axis"],
            str(row["value"]),
            f"{c['rate']:.0f}",
            f"{c['per_core']:.0f}",
            f"per {c['unit']}: {parts}",
            str(row["load"]["load_1_5_15"][0]),
        )
    console.print(table)


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", nargs="+", default=["admission", "relay", "billing", "bridge"])
    parser.add_argument("--requests", type=int, default=3_000, help="per admission point")
    parser.add_argument("--events", type=int, default=100_000, help="per billing point")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    exit_on_sigterm()
    console = make_console()
    result = asyncio.run(measure(args, console))
    path = write_result("growth", result)
    render(result, console)
    console.print(f"[dim]wrote {path}[/]")


if __name__ == "__main__":
    main()
