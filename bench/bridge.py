"""Stage: the SSE bridge, in tokens/s per core.

    .venvs/stream/bin/python -m bench.bridge [--concurrency 16 64] [--loops uvloop asyncio]
        [--profile] [--name NAME]

HTTP clients stream ``POST /v1/completions`` (``stream_options.include_usage``) through
the real bridge (``python -m bridge``), the real Faust job, and the real worker loop on
the pretend engine (``bench.fake_engine``, one token per engine step), as OpenAI clients
would. The bridge's cost per token is its process's CPU seconds over the tokens its
clients received; the other services' CPU is reported beside it. The clients run in this
process, so on two cores they take CPU from everything they measure: read tokens/s
(wall) as a floor, and the per-core figure as the stage's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.admission import print_profile
from bench.common import (
    add_settings_args,
    bench_settings,
    exit_on_sigterm,
    make_console,
    model_dir,
    parse_overrides,
    print_table,
    progress,
    progress_task,
)
from bench.procstat import CpuMeter
from bench.profile import Profiler, top_frames
from bench.report import RESULTS_DIR, uptime_load, write_result
from bench.services import start_bridge, start_fake_worker, start_job
from bench.stats import summarize
from bench.workload import prompt
from tokenbus.tenants import hash_api_key
from tokenbus_cli.stack import Stack

PROCESSES = ("bridge", "stream_job", "workers", "broker")


def api_key(i: int) -> str:
    return f"tb-bench-bridge-{i:04d}"


def write_tenants(path: Path, num_tenants: int) -> None:
    tenants = {
        f"bench-bridge-{i:04d}": {"api_key_sha256": [hash_api_key(api_key(i))]}
        for i in range(num_tenants)
    }
    path.write_text(json.dumps({"tenants": tenants}))


async def stream_one(
    http: httpx.AsyncClient, key: str, body: dict[str, Any]
) -> tuple[int, int, float]:
    """One streamed completion: (completion tokens by usage, content events, TTFT s)."""
    started = time.perf_counter()
    ttft = 0.0
    num_events = num_tokens = 0
    headers = {"Authorization": f"Bearer {key}"}
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0].get("text"):
                num_events += 1
                ttft = ttft or time.perf_counter() - started
    return num_tokens, num_events, ttft


async def run_bridge(
    *,
    num_requests: int,
    max_tokens: int,
    concurrency: int,
    num_tenants: int = 10,
    num_workers: int = 1,
    prompt_tokens: int = 150,
    overrides: dict[str, Any] | None = None,
    profile_to: Path | None = None,
    on_progress: Callable[[int], None] = lambda n: None,
) -> dict[str, Any]:
    settings = bench_settings(model_path=model_dir(), **(overrides or {}))
    tenants_file = settings.home / "tenants.json"
    write_tenants(tenants_file, num_tenants)
    settings = settings.model_copy(update={"tenants_file": tenants_file})
    stack = Stack(settings)
    num_tokens = num_events = 0
    ttfts: list[float] = []
    try:
        await stack.start_broker()
        await start_job(stack)
        worker_ids = [f"fake-{i}" for i in range(num_workers)]
        for worker_id in worker_ids:
            await start_fake_worker(stack, worker_id)
        await start_bridge(stack)
        body = {
            "model": settings.served_model_name,
            "prompt": prompt(0, 0, prompt_tokens),
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{settings.bridge_port}", limits=limits, timeout=120
        )
        next_index = iter(range(num_requests))

        async def lane() -> None:
            nonlocal num_tokens, num_events
            for i in next_index:
                tokens, events, ttft = await stream_one(http, api_key(i % num_tenants), body)
                num_tokens += tokens
                num_events += events
                ttfts.append(ttft)
                on_progress(num_tokens)

        # The job starts routing once it has seen the worker's heartbeat: one request
        # before the clock starts, so the measured run is the steady state.
        await stream_one(http, api_key(0), {**body, "max_tokens": 1})
        meter = CpuMeter(
            {
                **{name: [stack.pid(name)] for name in ("bridge", "stream_job", "broker")},
                "workers": [stack.pid(w) for w in worker_ids],
            }
        )
        profilers = []
        if profile_to is not None:
            profilers = [Profiler(stack.pid("bridge"), profile_to.with_suffix(".bridge.txt"))]
        meter.start()
        cpu_clients = time.process_time()
        started = time.perf_counter()
        try:
            await asyncio.gather(*(lane() for _ in range(concurrency)))
        finally:
            await http.aclose()
        wall_s = time.perf_counter() - started
        cpu = {**meter.delta(), "clients": round(time.process_time() - cpu_clients, 3)}
        profiles = [top_frames(p.stop()) for p in profilers]
    finally:
        stack.stop()
        shutil.rmtree(settings.home, ignore_errors=True)
    return {
        "event_loop": settings.event_loop,
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "num_tenants": num_tenants,
        "num_workers": num_workers,
        "prompt_tokens": prompt_tokens,
        "num_tokens": num_tokens,
        "num_events": num_events,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(num_tokens / wall_s, 1),
        "ttft_ms": summarize(ttfts, 1000),
        "cpu_s": cpu,
        "bridge_tokens_per_core_s": round(num_tokens / max(1e-9, cpu["bridge"]), 1),
        "us_per_token": {
            name: round(1e6 * seconds / max(1, num_tokens), 2) for name, seconds in cpu.items()
        },
        "profile": {"bridge": profiles[0]} if profiles else None,
    }


COLUMNS = (
    "services' loop",
    "concurrency",
    "tokens/s (wall)",
    "bridge tokens/s per core",
    "bridge µs/token",
    "job µs/token",
    "worker µs/token",
    "broker µs/token",
    "clients µs/token",
    "TTFT p50 ms",
    "TTFT p99 ms",
)


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        us = r["us_per_token"]
        out.append(
            [
                r["event_loop"],
                str(r["concurrency"]),
                f"{r['tokens_per_s']:.0f}",
                f"{r['bridge_tokens_per_core_s']:.0f}",
                # "fake-0": results from before the workers were counted together
                *(f"{us.get(name, us.get('fake-0', 0.0)):.1f}" for name in PROCESSES),
                f"{us['clients']:.1f}",
                f"{r['ttft_ms']['p50']:.1f}",
                f"{r['ttft_ms']['p99']:.1f}",
            ]
        )
    return out


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    load_start = uptime_load()
    rows = []
    with progress(make_console()) as bar:
        for event_loop in args.loops:
            for concurrency in args.concurrency:
                advance = progress_task(
                    bar,
                    f"bridge on {event_loop}, concurrency {concurrency}",
                    args.requests * args.max_tokens,
                )
                rows.append(
                    await run_bridge(
                        num_requests=args.requests,
                        max_tokens=args.max_tokens,
                        concurrency=concurrency,
                        overrides={**parse_overrides(args.set), "event_loop": event_loop},
                        profile_to=RESULTS_DIR / "bridge.pyspy" if args.profile else None,
                        on_progress=advance,
                    )
                )
    return {"load_start": load_start, "load_end": uptime_load(), "results": rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument(
        "--loops",
        nargs="+",
        default=["uvloop", "asyncio"],
        choices=["uvloop", "asyncio"],
        help="the services' event loop (Settings.event_loop), one run each",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the bridge")
    parser.add_argument("--name", help="result file name (default: bridge, or bridge-profile)")
    add_settings_args(parser)
    args = parser.parse_args()
    exit_on_sigterm()
    result = asyncio.run(_main(args))
    name = args.name or ("bridge-profile" if args.profile else "bridge")
    path = write_result(name, result)
    print_table("the SSE bridge", COLUMNS, table_rows(result["results"]), path)
    for row in result["results"]:
        if row["profile"]:
            print_profile(
                row["profile"]["bridge"],
                make_console(),
                f"bridge, concurrency {row['concurrency']}",
            )


if __name__ == "__main__":
    main()
