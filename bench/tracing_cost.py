"""What tracing costs: the same waves with every request traced and with none, in one run.

    .venvs/stream/bin/python -m bench.tracing_cost --rounds 8 --concurrency 64 --direct

One private ``Stack`` (as ``bench.overhead`` starts it). Each wave sends its requests
with a W3C ``traceparent`` the client chose: sampled (every service records its spans,
which travel through the spans topic into ClickHouse) or not sampled (the services'
parent-based samplers record nothing), alternating wave by wave and swapping order every
round, so the machine's noise lands on both arms. Per arm: TTFT p50/p99 and the CPU per
token of tokenbus's processes on the path (job, worker loop process, billing, client),
and of the broker, from /proc.

Each round's two waves of one concurrency are a pair, run back to back: the cost is the
median over rounds of each pair's added CPU per token, with its min..max, so a machine
whose load drifts during the run moves both sides of a pair together. ``--direct`` then
measures tracing's own work per request in this process (``bench.tracing_work``) and sets
it beside this run's untraced CPU per token.
"""

from __future__ import annotations

import argparse
import asyncio
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
from bench.tracing_work import STAGES
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


def paired(
    cpu: dict[tuple[str, int], list[dict[str, float]]],
    waves: dict[tuple[str, int], list[WaveResult]],
    concurrency: int,
) -> dict[str, Any]:
    """Tracing's added CPU per token, round by round (the traced wave over the untraced
    one of the same round): median and min..max, in all and per process."""

    def per_token(arm: str, index: int) -> dict[str, float]:
        wave = waves[(arm, concurrency)][index]
        tokens = max(1, sum(t.num_tokens for t in wave.traces if t.error is None))
        used = cpu[(arm, concurrency)][index]
        figures = {k: 1e6 * used.get(k, 0.0) / tokens for k in (*PROCESSES, "broker")}
        figures["tokenbus"] = sum(figures[k] for k in PROCESSES)
        return figures

    rounds = range(len(cpu[("traced", concurrency)]))
    pairs = [(per_token("traced", i), per_token("untraced", i)) for i in rounds]
    out: dict[str, Any] = {"num_rounds": len(pairs)}
    for key in (*PROCESSES, "tokenbus", "broker"):
        added = [100 * (on[key] - off[key]) / off[key] for on, off in pairs if off[key]]
        out[f"{key}_added_pct"] = _spread(added)
    out["untraced_tokenbus_us_per_token"] = _spread([off["tokenbus"] for _, off in pairs])
    out["traced_tokenbus_us_per_token"] = _spread([on["tokenbus"] for on, _ in pairs])
    return out


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"median": round(median, 2), "min": round(ordered[0], 2), "max": round(ordered[-1], 2)}


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
            {
                "concurrency": concurrency,
                **arms,
                "cost": compare(arms["traced"], arms["untraced"]),
                "paired": paired(cpu, waves, concurrency),
            }
        )
    direct = None
    if args.direct:
        from bench import tracing_work

        # Against the untraced CPU per token of the largest concurrency (where CPU per
        # token is the engine's work, not idle polling).
        base = rows[-1]["paired"]["untraced_tokenbus_us_per_token"]["median"]
        direct = await asyncio.to_thread(
            tracing_work.measure_sync,
            argparse.Namespace(
                requests=args.direct_requests,
                rounds=5,
                tokens=args.max_tokens,
                per_token_us=base,
                requests_per_s=50,
                gather_s=settings.span_gather_s,  # the stack's, --set included
            ),
        )
        # The bridge is not on this benchmark's path (the client produces to the job): its
        # span work is left out of the share, and shown beside it.
        on_path = {k: v for k, v in direct["per_request_us"]["traced"].items() if k in STAGES}
        off = direct["per_request_us"]["untraced"]
        added_on_path = sum(on_path[k] - off[k] for k in STAGES if k != "bridge")
        direct["added_us_per_request_without_bridge"] = round(added_on_path, 1)
        direct["share_without_bridge_pct"] = round(100 * added_on_path / args.max_tokens / base, 2)
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
        "load_after_direct": uptime_load() if direct is not None else None,
        "results": rows,
        "direct": direct,
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
        added = row["paired"]["tokenbus_added_pct"]
        table.add_row(
            "",
            "paired",
            "",
            "",
            f"{added['median']:+}% ({added['min']}..{added['max']})",
            "",
        )
    console.print(table)
    direct = result.get("direct")
    if direct:
        console.print(
            f"direct: {direct['added_us_per_request']} µs/request added "
            f"({direct['added_us_per_request_without_bridge']} without the bridge) = "
            f"{direct['share_without_bridge_pct']}% of "
            f"{direct['tokenbus_us_per_token']} µs/token without the bridge, "
            f"{direct['share_of_tokenbus_cpu_pct']}% with it"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-requests", type=int, default=32, help="per wave")
    parser.add_argument(
        "--direct",
        action="store_true",
        help="then measure tracing's own work per request (bench.tracing_work)",
    )
    parser.add_argument("--direct-requests", type=int, default=2000)
    add_settings_args(parser)
    run_benchmark(parser, argv, measure, render, "tracing")


if __name__ == "__main__":
    main()
