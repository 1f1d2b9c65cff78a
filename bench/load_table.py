"""The source design's load table as a scenario: 200 tenants at 150 requests/s, and 350
tenants at 240 requests/s, then higher rates until the system breaks.

    .venvs/stream/bin/python -m bench.load_table

The whole path runs: TokenbusClient --> requests topic --> Faust job --> worker topic
--> worker loop --> reply topic --> client, plus the billing sink. Workers are pretend
(``bench.fake_worker``: the real worker loop on ``bench.fake_engine``), because the
tiny model alone needs both cores for ~4,800 tokens/s and so could not tell the
pipeline's limit from its own. Arrivals are open-loop (Poisson), tenants uniform.

A point is broken when more than 1% of its requests fail or time out, when the p99
time to first token exceeds ``--slo-ttft-ms``, or when fewer than 95% of the offered
requests complete within the point's duration plus a grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.common import bench_settings, exit_on_sigterm, make_console, progress
from bench.procstat import CpuMeter
from bench.report import uptime_load, write_result
from bench.services import start_billing, start_fake_worker, start_job
from bench.stats import summarize
from bench.workload import prompt, tenant
from producers import TokenbusClient
from schemas import SamplingParams
from tokenbus.config import Settings
from tokenbus_cli.stack import Stack

GRACE_S = 10.0


@dataclass
class Outcome:
    submitted: float
    first_token: float | None = None
    finished: float | None = None
    error: str | None = None


async def one_request(
    client: TokenbusClient, tenant_id: str, text: str, sampling: SamplingParams, out: Outcome
) -> None:
    try:
        request = await client.submit(tenant_id=tenant_id, prompt=text, sampling=sampling)
        async for chunk in client.stream(request):
            if chunk.error is not None:
                out.error = chunk.error.code
                break
            if chunk.num_tokens and out.first_token is None:
                out.first_token = time.perf_counter()
        out.finished = time.perf_counter()
    except Exception as exc:  # a timeout is a figure here
        out.error = type(exc).__name__


async def run_point(
    client: TokenbusClient,
    meter: CpuMeter,
    num_tenants: int,
    rate: float,
    duration_s: float,
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    meter.start()
    cpu_client = time.process_time()
    started = time.perf_counter()
    next_at = started
    i = 0
    while next_at - started < duration_s:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        out = Outcome(submitted=time.perf_counter())
        outcomes.append(out)
        text = prompt(seed, i, args.prompt_tokens)
        t = tenant(rng.randrange(num_tenants))
        tasks.append(asyncio.create_task(one_request(client, t, text, sampling, out)))
        i += 1
        next_at += rng.expovariate(rate)
    offered_s = time.perf_counter() - started
    _, pending = await asyncio.wait(tasks, timeout=GRACE_S) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    cpu = {**meter.delta(), "client": round(time.process_time() - cpu_client, 3)}
    done = [o for o in outcomes if o.finished is not None and o.error is None]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error is not None or o.finished is None:
            code = o.error or "unfinished"
            errors[code] = errors.get(code, 0) + 1
    window_done = [
        o for o in done if o.finished is not None and o.finished - started <= duration_s + GRACE_S
    ]
    ttft = summarize([o.first_token - o.submitted for o in done if o.first_token], 1000)
    e2e = summarize([o.finished - o.submitted for o in done if o.finished], 1000)
    num_failed = sum(errors.values())
    broken_because = [
        reason
        for reason, hit in (
            ("errors > 1%", num_failed > 0.01 * len(outcomes)),
            (f"p99 TTFT > {args.slo_ttft_ms} ms", ttft.get("p99", 0) > args.slo_ttft_ms),
            ("< 95% completed", len(window_done) < 0.95 * len(outcomes)),
        )
        if hit
    ]
    return {
        "num_tenants": num_tenants,
        "offered_rps": rate,
        "measured_offered_rps": round(len(outcomes) / offered_s, 1),
        "completed_rps": round(len(done) / (offered_s + 1e-9), 1),
        "num_requests": len(outcomes),
        "num_completed": len(done),
        "errors": errors,
        "ttft_ms": ttft,
        "e2e_ms": e2e,
        "cpu_cores": {k: round(v / offered_s, 3) for k, v in cpu.items()},
        "broken": broken_because,
        "load": uptime_load(),
    }


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    settings: Settings = bench_settings(client_timeout_s=30, max_num_seqs=args.max_num_seqs)
    stack = Stack(settings)
    worker_ids = [f"fake-{i}" for i in range(args.workers)]
    rows: list[dict[str, Any]] = []
    points = [(int(t), float(r)) for t, r in (p.split(":") for p in args.points)]
    try:
        await stack.start_broker()
        await start_billing(stack)
        await start_job(stack)
        for worker_id in worker_ids:
            await start_fake_worker(stack, worker_id, step_ms=args.step_ms)
        meter = CpuMeter(
            {name: [stack.pid(name)] for name in ("broker", "billing", "stream_job", *worker_ids)}
        )
        async with TokenbusClient(settings) as client:
            await _wait_for_workers(client, num_workers=args.workers)
            with progress(console) as bar:
                task = bar.add_task("load points", total=None)
                seed = 0
                # The design's points, then the break point: from a low rate upwards,
                # until a point breaks. Each point starts on a drained system.
                plan = [("design", t, r) for t, r in points]
                plan += [("ramp", points[-1][0], float(r)) for r in args.ramp_rates]
                for kind, num_tenants, rate in plan:
                    if (
                        kind == "ramp"
                        and rows
                        and rows[-1]["kind"] == "ramp"
                        and rows[-1]["broken"]
                    ):
                        break
                    bar.update(task, description=f"{kind}: {num_tenants} tenants at {rate:.0f}/s")
                    drain_s = await _drain(client)
                    row = await run_point(
                        client, meter, num_tenants, rate, args.duration_s, args, seed
                    )
                    rows.append({"kind": kind, "drain_s_before": drain_s, **row})
                    seed += 1
                    bar.advance(task)
    finally:
        stack.stop()
        shutil.rmtree(settings.home, ignore_errors=True)
    return {
        "command": "python -m bench.load_table " + " ".join(args.argv),
        "parameters": {
            "workers": args.workers,
            "engine": f"pretend, step {args.step_ms} ms, max_num_seqs {args.max_num_seqs}",
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "duration_s": args.duration_s,
            "slo_ttft_ms": args.slo_ttft_ms,
        },
        "load_start": load_start,
        "load_end": uptime_load(),
        "results": rows,
    }


async def _drain(client: TokenbusClient, timeout_s: float = 180) -> float:
    """Waits until a probe's first token comes within 1 s: the last point's backlog is
    gone (its clients gave up, but the job and workers still serve what was queued)."""
    started = time.monotonic()
    sampling = SamplingParams(max_tokens=1)
    while time.monotonic() - started < timeout_s:
        out = Outcome(submitted=time.perf_counter())
        await one_request(client, "bench-probe", "probe", sampling, out)
        if out.error is None and out.first_token and out.first_token - out.submitted < 1.0:
            break
        await asyncio.sleep(1.0)
    return round(time.monotonic() - started, 1)


async def _wait_for_workers(
    client: TokenbusClient, num_workers: int, timeout_s: float = 60
) -> None:
    """Probes until requests complete (the job has seen the workers' heartbeats)."""
    deadline = time.monotonic() + timeout_s
    sampling = SamplingParams(max_tokens=1)
    while True:
        out = Outcome(submitted=time.perf_counter())
        await one_request(client, "bench-probe", "probe", sampling, out)
        if out.error is None:
            await asyncio.sleep(2 * num_workers * 0.5)  # every worker heartbeats once more
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no worker answered: {out.error}")
        await asyncio.sleep(0.5)


def render(result: dict[str, Any], console: Console) -> None:
    parameters = result["parameters"]
    table = Table(title=f"load table ({parameters['engine']}, {parameters['workers']} workers)")
    for column in (
        "point",
        "tenants",
        "offered/s",
        "done/s",
        "TTFT p50",
        "TTFT p99",
        "e2e p50",
        "e2e p99",
        "errors",
        "CPU cores (job/broker/workers/client)",
        "verdict",
    ):
        table.add_column(column, justify="right")
    for row in result["results"]:
        cores = row["cpu_cores"]
        workers = sum(v for k, v in cores.items() if k.startswith("fake-"))
        table.add_row(
            row.get("kind", "-"),
            str(row["num_tenants"]),
            f"{row['measured_offered_rps']:.0f}",
            f"{row['completed_rps']:.0f}",
            f"{row['ttft_ms'].get('p50', float('nan')):.0f}",
            f"{row['ttft_ms'].get('p99', float('nan')):.0f}",
            f"{row['e2e_ms'].get('p50', float('nan')):.0f}",
            f"{row['e2e_ms'].get('p99', float('nan')):.0f}",
            str(sum(row["errors"].values())),
            f"{cores['stream_job']:.2f}/{cores['broker']:.2f}/{workers:.2f}/{cores['client']:.2f}",
            "BROKEN: " + ", ".join(row["broken"]) if row["broken"] else "ok",
        )
    console.print(table)


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--points",
        nargs="+",
        default=["20:5", "200:150", "350:240"],
        help="tenants:req/s; the first, nearly idle, shows the floor",
    )
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=10.0, help="pretend engine step")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument(
        "--ramp-rates",
        type=float,
        nargs="*",
        default=[25, 50, 75, 100, 125, 150, 200, 240, 300, 400, 600],
        help="req/s at the last point's tenants, upwards until one breaks",
    )
    parser.add_argument("--name", help="result file name (default: from the options)")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    exit_on_sigterm()
    console = make_console()
    result = asyncio.run(measure(args, console))
    path = write_result(args.name or "load_table", result)
    render(result, console)
    console.print(f"[dim]wrote {path}[/]")


if __name__ == "__main__":
    main()
