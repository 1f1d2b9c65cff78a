"""Stage: billing ingest, usage topic --> billing sink --> ClickHouse (chdb), in events/s.

    .venvs/stream/bin/python -m bench.billing_ingest [--events 200000] [--profile]

A backlog of UsageEvents is produced first; then the real sink (``python -m billing``,
embedded ClickHouse in its own home) is started and drains it. The rate is taken from
the sink's own counters (``/healthz``), from its first insert to its last, so start-up
(chdb, migrations, the group join) is not counted; CPU is the sink process's over the
same span, with the kernel's share of it and the sink's minor page faults per event
(``--set billing_heap_reserve_mb=0`` runs the sink without its heap reserve).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.admission import print_profile
from bench.common import (
    add_settings_args,
    bench_settings,
    parse_overrides,
    progress,
    run_benchmark,
)
from bench.procstat import cpu_seconds, minor_faults, system_seconds
from bench.profile import Profiler, top_frames
from bench.report import RESULTS_DIR, uptime_load
from bench.services import start_billing
from bench.workload import tenant
from schemas import FinishReason, UsageEvent, UsageStatus, encode
from tokenbus.config import Settings
from tokenbus.kafka import make_producer
from tokenbus.topics import Topics
from tokenbus_cli.stack import Stack

GOAL_EVENTS_PER_S = 100_000


def build_events(num_events: int, num_tenants: int) -> list[tuple[str, bytes]]:
    base = datetime(2026, 1, 1, tzinfo=UTC)
    out: list[tuple[str, bytes]] = []
    for i in range(num_events):
        tenant_id = tenant(i % num_tenants)
        created = base + timedelta(milliseconds=i)
        event = UsageEvent(
            request_id=f"req_ingest{i:010d}",
            session_id=f"sess_ingest{i // 4:010d}",
            tenant_id=tenant_id,
            model="tiny-llama",
            worker_id="worker-0",
            priority=1,
            status=UsageStatus.OK,
            finish_reason=FinishReason.LENGTH,
            num_prompt_tokens=150,
            num_completion_tokens=64,
            queue_ms=1.5,
            ttft_ms=12.0,
            total_ms=230.0,
            precision="fp32",
            created_at=created,
            finished_at=created + timedelta(milliseconds=230),
        )
        out.append((tenant_id, encode(event)))
    return out


def _health(settings: Settings) -> dict[str, Any]:
    url = f"http://127.0.0.1:{settings.billing_query_port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            data: dict[str, Any] = json.loads(response.read())
            return data
    except OSError:
        return {}


async def run_ingest(
    *,
    num_events: int = 200_000,
    num_tenants: int = 10,
    overrides: dict[str, Any] | None = None,
    profile_to: Path | None = None,
    on_progress: Callable[[int], None] = lambda n: None,
) -> dict[str, Any]:
    settings = bench_settings(**(overrides or {}))
    topics = Topics(settings.topic_prefix)
    stack = Stack(settings)
    producer = make_producer(settings, linger_ms=5, max_batch_size=512 * 1024)
    # (time, rows handled, sink CPU s, of it the kernel's, the sink's minor faults)
    samples: list[tuple[float, int, float, float, int]] = []
    try:
        await stack.start_broker()
        await producer.start()
        events = build_events(num_events, num_tenants)
        sends = [
            await producer.send(topics.usage, value, key=tenant_id.encode())
            for tenant_id, value in events
        ]
        await asyncio.gather(*sends)
        await producer.stop()
        await start_billing(stack)
        pid = stack.pid("billing")
        profiler = Profiler(pid, profile_to) if profile_to else None
        deadline = time.monotonic() + 120 + num_events / 2_000
        handled = 0
        while handled < num_events and time.monotonic() < deadline:
            health = await asyncio.to_thread(_health, settings)
            handled = int(health.get("num_inserted", 0)) + int(health.get("num_duplicates", 0))
            samples.append(
                (
                    time.perf_counter(),
                    handled,
                    cpu_seconds(pid),
                    system_seconds(pid),
                    minor_faults(pid),
                )
            )
            on_progress(handled)
            await asyncio.sleep(0.05)
        profile = top_frames(profiler.stop()) if profiler else None
        num_duplicates = int(health.get("num_duplicates", 0))
    finally:
        await producer.stop()
        stack.stop()
        shutil.rmtree(settings.home, ignore_errors=True)
    # From the last sample before the first insert to the first sample that saw them all.
    first = max((s for s in samples if s[1] == 0), key=lambda s: s[0], default=samples[0])
    last = next((s for s in samples if s[1] >= num_events), samples[-1])
    wall_s = max(1e-9, last[0] - first[0])
    cpu_s = max(1e-9, last[2] - first[2])
    num_seen = max(1, last[1])
    return {
        "num_events": num_events,
        "num_handled": last[1],
        "num_duplicates": num_duplicates,
        "num_tenants": num_tenants,
        "batch_rows": settings.billing_batch_rows,
        "wall_s": round(wall_s, 3),
        "events_per_s": round(last[1] / wall_s, 1),
        "sink_cpu_s": round(cpu_s, 3),
        "events_per_core_s": round(last[1] / cpu_s, 1),
        "us_cpu_per_event": round(cpu_s / num_seen * 1e6, 2),
        "us_system_per_event": round((last[3] - first[3]) / num_seen * 1e6, 2),
        "minor_faults_per_event": round((last[4] - first[4]) / num_seen, 3),
        "heap_reserve_mb": settings.billing_heap_reserve_mb,
        "profile": profile,
    }


def render(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    table = Table(title=title)
    columns = (
        "tenants",
        "batch rows",
        "heap reserve MiB",
        "events",
        "events/s",
        "goal",
        "events/s/core",
        "µs CPU/event",
        "of it kernel",
        "minor faults/event",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["num_tenants"]),
            str(row["batch_rows"]),
            str(row.get("heap_reserve_mb", "-")),
            str(row["num_handled"]),
            f"{row['events_per_s']:.0f}",
            "met" if row["events_per_s"] >= GOAL_EVENTS_PER_S else "NOT met",
            f"{row['events_per_core_s']:.0f}",
            _figure(row, "us_cpu_per_event", ".2f"),
            _figure(row, "us_system_per_event", ".2f"),
            _figure(row, "minor_faults_per_event", ".3f"),
        )
    console.print(table)


def _figure(row: dict[str, Any], key: str, spec: str) -> str:
    """A figure that result files older than it lack shows as a dash."""
    return format(row[key], spec) if key in row else "-"


async def _main(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    with progress(console) as bar:
        task = bar.add_task("billing ingest", total=args.events)
        row = await run_ingest(
            num_events=args.events,
            num_tenants=args.tenants,
            overrides=parse_overrides(args.set),
            profile_to=RESULTS_DIR / "billing.pyspy.txt" if args.profile else None,
            on_progress=lambda n: bar.update(task, completed=n),
        )
    return {
        "load_start": load_start,
        "load_end": uptime_load(),
        "goal_events_per_s": GOAL_EVENTS_PER_S,
        "results": [row],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="py-spy the sink (slows it)")
    parser.add_argument("--name", default="billing")
    add_settings_args(parser)
    run_benchmark(
        parser, None, _main, _show, lambda args: args.name + ("-profile" if args.profile else "")
    )


def _show(result: dict[str, Any], console: Console) -> None:
    render(result["results"], console, "billing ingest: usage topic --> sink --> chdb")
    print_profile(result["results"][0]["profile"], console, "billing sink")


if __name__ == "__main__":
    main()
