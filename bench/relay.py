"""Stage: token relay over the reply topics, in tokens/s per core.

    .venvs/stream/bin/python -m bench.relay [--tokens-per-step 1] [--profile]

The real worker loop (``workers.worker.Worker``) on a pretend engine that emits one
delta per request per engine step (``bench.fake_engine``), a broker, and the real
``TokenbusClient`` reading its reply topic. Requests go straight to the worker's topic,
as the ``WorkItem``s the job would forward (admission is measured by ``bench.admission``).
Per core means tokens divided by the CPU seconds of the worker process (minus what the
pretend engine itself costs, measured alone), the broker, and this client process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.admission import print_profile
from bench.common import (
    add_settings_args,
    bench_settings,
    parse_overrides,
    profiled_name,
    progress,
    progress_task,
    run_benchmark,
)
from bench.fake_engine import FakeEngine
from bench.procstat import CpuMeter
from bench.profile import Profiler, top_frames
from bench.report import RESULTS_DIR, uptime_load
from bench.services import start_fake_worker
from bench.workload import prompt, tenant
from producers import TokenbusClient
from schemas import InferenceRequest, SamplingParams, WorkItem, encode
from tokenbus.kafka import make_producer
from tokenbus.topics import Topics
from tokenbus_cli.stack import Stack
from workers.interface import GenerateOptions, GenerateParams

GOAL_PER_CORE = 50_000


async def engine_only_cpu_s(
    num_requests: int, max_tokens: int, tokens_per_step: int, concurrency: int
) -> float:
    """CPU the pretend engine spends alone on the same work: subtracted from the worker."""
    engine = FakeEngine("fake", concurrency, tokens_per_step=tokens_per_step)
    params = GenerateParams(max_tokens=max_tokens, ignore_eos=True)
    text = prompt(0, 0)

    async def one(i: int) -> None:
        async for _ in engine.generate(f"r{i}", text, params, GenerateOptions()):
            pass

    started = time.process_time()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    return time.process_time() - started


async def run_relay(
    *,
    num_requests: int = 256,
    max_tokens: int = 256,
    concurrency: int = 64,
    tokens_per_step: int = 1,
    step_ms: float = 0.0,
    num_tenants: int = 10,
    num_workers: int = 1,
    prompt_tokens: int = 150,
    overrides: dict[str, Any] | None = None,
    profile_to: Path | None = None,
    on_progress: Callable[[int], None] = lambda n: None,
) -> dict[str, Any]:
    settings = bench_settings(**(overrides or {}))
    topics = Topics(settings.topic_prefix)
    worker_ids = [f"fake-{i}" for i in range(num_workers)]
    stack = Stack(settings)
    producer = make_producer(settings)
    client = TokenbusClient(settings)
    num_tokens = num_chunks = num_gaps = 0
    try:
        await stack.start_broker({topics.worker(w): 1 for w in worker_ids})
        for worker_id in worker_ids:
            await start_fake_worker(
                stack,
                worker_id,
                step_ms=step_ms,
                tokens_per_step=tokens_per_step,
            )
        await producer.start()
        await client.start()
        text = prompt(0, 0, prompt_tokens)
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        next_index = iter(range(num_requests))

        async def lane() -> None:
            nonlocal num_tokens, num_chunks, num_gaps
            for i in next_index:
                tenant_id = tenant(i % num_tenants)
                worker_id = worker_ids[i % num_workers]
                now = datetime.now(UTC)
                # The producer's request (what the client streams), and the WorkItem the
                # job would make of it and forward: what the worker decodes.
                request = InferenceRequest(
                    request_id=f"req_relay{i:09d}",
                    session_id=f"sess_relay{i:09d}",
                    tenant_id=tenant_id,
                    model=settings.served_model_name,
                    prompt=text,
                    sampling=sampling,
                    reply_to=client.reply_topic,
                    created_at=now,
                )
                item = WorkItem(
                    request_id=request.request_id,
                    session_id=f"sess_relay{i:09d}",
                    tenant_id=tenant_id,
                    model=request.model,
                    prompt=text,
                    sampling=sampling,
                    reply_to=client.reply_topic,
                    created_at=now,
                    admitted_at=now,
                    cache_salt=tenant_id,
                    worker_id=worker_id,
                    dispatched_at=now,
                )
                client.watch(request.request_id, tenant_id)
                await producer.send_and_wait(
                    topics.worker(worker_id), encode(item), key=tenant_id.encode()
                )
                expected_seq = 0
                async for chunk in client.stream(request):
                    num_gaps += chunk.seq != expected_seq
                    expected_seq = chunk.seq + 1
                    num_tokens += chunk.num_tokens
                    num_chunks += 1
                on_progress(num_tokens)

        pids = {name: stack.pid(name) for name in ["broker", *worker_ids]}
        meter = CpuMeter({"broker": [pids["broker"]], "worker": [pids[w] for w in worker_ids]})
        profilers = []
        if profile_to is not None:
            profilers = [
                Profiler(pids[worker_ids[0]], profile_to.with_suffix(".worker.txt")),
                Profiler(os.getpid(), profile_to.with_suffix(".client.txt")),
            ]
        meter.start()
        cpu_client = time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
        cpu = {**meter.delta(), "client": round(time.process_time() - cpu_client, 3)}
        profiles = [top_frames(p.stop()) for p in profilers]
    finally:
        await client.close()
        await producer.stop()
        stack.stop()
        shutil.rmtree(settings.home, ignore_errors=True)
    engine_s = await engine_only_cpu_s(num_requests, max_tokens, tokens_per_step, concurrency)
    worker_loop_s = max(0.0, cpu["worker"] - engine_s)
    pipeline_s = worker_loop_s + cpu["broker"] + cpu["client"]
    return {
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "tokens_per_step": tokens_per_step,
        "step_ms": step_ms,
        "num_tenants": num_tenants,
        "num_workers": num_workers,
        "prompt_tokens": prompt_tokens,
        "num_tokens": num_tokens,
        "num_chunks": num_chunks,
        "num_seq_gaps": num_gaps,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(num_tokens / wall_s, 1),
        "chunks_per_s": round(num_chunks / wall_s, 1),
        "cpu_s": {
            **cpu,
            "pretend_engine_alone": round(engine_s, 3),
            "worker_loop": round(worker_loop_s, 3),
        },
        "tokens_per_core_s": round(num_tokens / max(1e-9, pipeline_s), 1),
        "us_per_token": {
            part: round(1e6 * value / max(1, num_tokens), 2)
            for part, value in {
                "worker_loop": worker_loop_s,
                "broker": cpu["broker"],
                "client": cpu["client"],
            }.items()
        },
        "profile": {"worker": profiles[0], "client": profiles[1]} if profiles else None,
    }


def render(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    table = Table(title=title)
    columns = (
        "tok/step",
        "tenants",
        "workers",
        "prompt tok",
        "tok/s",
        "chunks/s",
        "tok/s/core",
        "goal",
    )
    for column in (*columns, "µs/tok worker", "µs/tok broker", "µs/tok client"):
        table.add_column(column, justify="right")
    for row in rows:
        us = row["us_per_token"]
        table.add_row(
            str(row["tokens_per_step"]),
            str(row["num_tenants"]),
            str(row["num_workers"]),
            str(row["prompt_tokens"]),
            f"{row['tokens_per_s']:.0f}",
            f"{row['chunks_per_s']:.0f}",
            f"{row['tokens_per_core_s']:.0f}",
            "met" if row["tokens_per_core_s"] >= GOAL_PER_CORE else "NOT met",
            f"{us['worker_loop']:.1f}",
            f"{us['broker']:.1f}",
            f"{us['client']:.1f}",
        )
    console.print(table)


async def _main(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    rows = []
    with progress(console) as bar:
        for tokens_per_step in args.tokens_per_step:
            advance = progress_task(
                bar, f"relay, {tokens_per_step} token(s) per step", args.requests * args.max_tokens
            )
            rows.append(
                await run_relay(
                    num_requests=args.requests,
                    max_tokens=args.max_tokens,
                    concurrency=args.concurrency,
                    tokens_per_step=tokens_per_step,
                    overrides=parse_overrides(args.set),
                    profile_to=RESULTS_DIR / "relay.pyspy" if args.profile else None,
                    on_progress=advance,
                )
            )
    return {
        "load_start": load_start,
        "load_end": uptime_load(),
        "goal_per_core": GOAL_PER_CORE,
        "results": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--tokens-per-step",
        type=int,
        nargs="+",
        default=[1, 4, 16],
        help="tokens in each delta: 1 is vLLM's DELTA output in decode; more imitates coalescing",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the worker and the client")
    parser.add_argument("--name", help="result file name (default: from the options)")
    add_settings_args(parser)
    run_benchmark(parser, None, _main, _show, profiled_name("relay"))


def _show(result: dict[str, Any], console: Console) -> None:
    render(result["results"], console, "token relay over the reply topics")
    for row in result["results"]:
        if row["profile"]:
            print_profile(
                row["profile"]["worker"], console, f"worker, {row['tokens_per_step']} tok/step"
            )
            print_profile(
                row["profile"]["client"], console, f"client, {row['tokens_per_step']} tok/step"
            )


if __name__ == "__main__":
    main()
