"""What tracing costs: the same waves with every request traced and with none, in one run.

    .venvs/stream/bin/python -m bench.tracing_cost --rounds 3 --concurrency 1 64

One private ``Stack`` (as ``bench.overhead`` starts it). Each wave sends its requests
with a W3C ``traceparent`` the client chose: sampled (every service records its spans,
which travel through the spans topic into ClickHouse) or not sampled (the services'
parent-based samplers record nothing), alternating wave by wave and swapping order every
round, so the machine's noise lands on both arms. Per arm: TTFT p50/p99 and the CPU per
token of tokenbus's processes on the path (job, worker loop process, billing, client),
and of the broker, from /proc.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.trace.span import INVALID_SPAN_ID, INVALID_TRACE_ID
from rich.console import Console
from rich.table import Table

from bench.common import (
    add_settings_args,
    bench_settings,
    model_dir,
    parse_overrides,
    run_benchmark,
)
from bench.driver import WaveResult, run_wave
from bench.overhead import stack_meter
from bench.report import uptime_load
from bench.stats import ratio, summarize
from bench.workload import prompts, tenant
from producers import RequestFailed, TokenbusClient
from schemas import SamplingParams
from tokenbus_cli.stack import Stack

ARMS = ("traced", "untraced")
PROCESSES = ("stream_job", "worker_process", "billing", "client")
"""tokenbus's processes on the path; the broker is reported beside them."""
TENANT = tenant(0)


def parent_context(sampled: bool) -> Any:
    """A caller's span for one request: sampled or not, as a ``traceparent`` says."""
    trace_id = int.from_bytes(os.urandom(16), "big") or INVALID_TRACE_ID + 1
    span_id = int.from_bytes(os.urandom(8), "big") or INVALID_SPAN_ID + 1
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    context = SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)
    return set_span_in_context(NonRecordingSpan(context))


def arm_summary(waves: list[WaveResult], cpu: list[dict[str, float]]) -> dict[str, Any]:
    """One arm's figures over its waves: TTFT quantiles, tokens, CPU µs per token."""
    traces = [t for w in waves for t in w.traces]
    done = [t for t in traces if t.error is None]
    num_tokens = sum(t.num_tokens for t in done)
    totals = {k: sum(c.get(k, 0.0) for c in cpu) for k in (*PROCESSES, "broker")}
    per_token = {k: round(1e6 * v / max(1, num_tokens), 2) for k, v in totals.items()}
    tokenbus = sum(per_token[k] for k in PROCESSES)
    return {
        "num_requests": len(traces),
        "num_errors": len(traces) - len(done),
        "num_tokens": num_tokens,
        "ttft_ms": summarize([t.ttft_s for t in done if t.ttft_s is not None], 1000),
        "us_cpu_per_token": {**per_token, "tokenbus": round(tokenbus, 2)},
    }


def compare(traced: dict[str, Any], untraced: dict[str, Any]) -> dict[str, Any]:
    """Tracing's cost: the traced arm over the untraced one."""
    on, off = traced["us_cpu_per_token"]["tokenbus"], untraced["us_cpu_per_token"]["tokenbus"]
    return {
        "cpu_per_token_ratio": ratio(on, off),
        "cpu_per_token_added_pct": round(100 * (on - off) / off, 2) if off else None,
        "ttft_p50_ratio": ratio(traced["ttft_ms"]["p50"], untraced["ttft_ms"]["p50"]),
        "ttft_p99_ratio": ratio(traced["ttft_ms"]["p99"], untraced["ttft_ms"]["p99"]),
    }


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    settings = bench_settings(model_path=model_dir(), **parse_overrides(args.set))
    (settings.home / "logs").mkdir(parents=True, exist_ok=True)
    stack = Stack(settings, on_progress=lambda m: console.print(f"[dim]stack: {m}[/]"))
    waves: dict[tuple[str, int], list[WaveResult]] = {}
    cpu: dict[tuple[str, int], list[dict[str, float]]] = {}
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        await stack.start()
        meter = stack_meter(stack)
        async with TokenbusClient(settings) as client:

            def streamer(sampled: bool) -> Any:
                async def stream(index: int, text: str) -> AsyncIterator[int]:
                    # The client injects the current context: this request's parent.
                    from opentelemetry import context as otel_context

                    token = otel_context.attach(parent_context(sampled))
                    try:
                        request = await client.submit(
                            tenant_id=TENANT, prompt=text, sampling=sampling
                        )
                    finally:
                        otel_context.detach(token)
                    async for chunk in client.stream(request):
                        if chunk.error is not None:
                            raise RequestFailed(chunk.error)
                        yield chunk.num_tokens

                return stream

            await run_wave(streamer(True), prompts(-1, 16), 8)  # warm-up, both paths
            await run_wave(streamer(False), prompts(-2, 16), 8)
            for round_index in range(args.rounds):
                order = ARMS if round_index % 2 == 0 else ARMS[::-1]
                for concurrency in args.concurrency:
                    for arm in order:
                        texts = prompts(round_index, max(args.min_requests, 2 * concurrency))
                        meter.start()
                        cpu_client = time.process_time()
                        wave = await run_wave(streamer(arm == "traced"), texts, concurrency)
                        used = {**meter.delta(), "client": time.process_time() - cpu_client}
                        waves.setdefault((arm, concurrency), []).append(wave)
                        cpu.setdefault((arm, concurrency), []).append(used)
                        console.print(
                            f"round {round_index} c={concurrency} {arm}: "
                            f"{wave.summary()['tokens_per_s']} tok/s"
                        )
                        stack.check()
    finally:
        stack.stop()
    load_end = uptime_load()
    if not args.keep:
        shutil.rmtree(settings.home, ignore_errors=True)
    rows = []
    for concurrency in args.concurrency:
        arms = {
            arm: arm_summary(waves[(arm, concurrency)], cpu[(arm, concurrency)]) for arm in ARMS
        }
        rows.append(
            {"concurrency": concurrency, **arms, "cost": compare(arms["traced"], arms["untraced"])}
        )
    return {
        "command": "python -m bench.tracing_cost " + " ".join(args.argv),
        "parameters": {
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "settings_overrides": parse_overrides(args.set),
        },
        "load_start": load_start,
        "load_end": load_end,
        "results": rows,
    }


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title="tracing on vs off (same run)")
    for column in ("c", "arm", "TTFT p50 ms", "TTFT p99 ms", "tokenbus µs/token", "broker"):
        table.add_column(column, justify="right")
    for row in result["results"]:
        for arm in ARMS:
            figures = row[arm]
            table.add_row(
                str(row["concurrency"]),
                arm,
                f"{figures['ttft_ms']['p50']:.1f}",
                f"{figures['ttft_ms']['p99']:.1f}",
                f"{figures['us_cpu_per_token']['tokenbus']:.1f}",
                f"{figures['us_cpu_per_token']['broker']:.1f}",
            )
        cost = row["cost"]
        table.add_row(
            "",
            "cost",
            f"x{cost['ttft_p50_ratio']}",
            f"x{cost['ttft_p99_ratio']}",
            f"{cost['cpu_per_token_added_pct']:+}%",
            "",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-requests", type=int, default=32, help="per wave")
    add_settings_args(parser)
    run_benchmark(parser, argv, measure, render, "tracing")


if __name__ == "__main__":
    main()
