"""Overhead against direct vLLM: the same engine, prompts and sampling, with and without
tokenbus in front, at concurrency 1, 16 and 64.

    .venvs/stream/bin/python -m bench.overhead          # or: make bench

- tokenbus arm: TokenbusClient --> requests topic --> Faust job --> worker topic -->
  worker (VllmEngine) --> reply topic --> client, on a private ``tokenbus_cli.stack.Stack``
  (free ports, its own TOKENBUS_HOME, the tiny model).
- direct arm: the same ``workers.vllm_engine.VllmEngine``, built from the same Settings,
  driven in-process by ``bench.direct_vllm`` in the worker environment.

Both engines stay loaded; the arms alternate wave by wave (and swap order every round),
so the machine's noise lands on both. Pipeline CPU is counted from /proc: broker, Faust
job, billing sink, this client process, and the worker process minus what the direct
arm's process spends on the same wave (that is the AsyncLLM front end both arms pay);
the engine core processes are excluded from both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.admission import print_profile
from bench.common import (
    add_pin_job_arg,
    add_settings_args,
    bench_settings,
    model_dir,
    parse_overrides,
    profiled_name,
    progress,
    run_benchmark,
)
from bench.direct_arm import DirectProcess
from bench.driver import RequestTrace, WaveResult, run_wave
from bench.hop import floor as hop_floor
from bench.procstat import (
    CpuMeter,
    descendants,
    pin_threads,
    runqueue_wait_seconds,
    times_scheduled,
    write_syscalls,
)
from bench.profile import Profiler, merge_raw, top_frames
from bench.report import uptime_load
from bench.stats import added_ttft_ms, ratio, summarize
from bench.workload import prompts, tenant
from producers import RequestFailed, TokenbusClient
from schemas import SamplingParams
from tokenbus.config import Settings
from tokenbus_cli.stack import Stack
from workers.worker import PATH_PHASES

TENANT = tenant(0)
MIN_REQUESTS = 64
"""Requests a wave at least. A percentile is taken over a concurrency's waves pooled
(``rounds`` of them): at 32 a wave, the c=1 p99 of 96 requests was their nearest-rank
99th, the worst of them, so one stall set the goal's figure. At 64, three rounds give 192
requests and the p99 is the second worst; the worst is reported as ``max`` beside it.
Where concurrency times ``--requests-per-lane`` is larger (c=64: 128), that sets the wave."""
WARMUP_ROUND = -1
ARM_SETTLE_S = 1.5
"""Pause before each wave, so one arm's wave starts with the other arm's engine quiet.

vLLM on the CPU runs its model in a worker process that reads each step from a shared
memory queue and, after its last read, spins on ``sched_yield`` for one second
(``SpinCondition.busy_loop_s`` in vLLM's ``shm_broadcast``) before it waits on a socket:
``bench.engine_spin`` measured a whole core in the first half second after a wave's
end, a third of one in the next, 0.02 after that. The direct arm's engine runs at
niceness 0 and the stack's worker at ``worker_nice``, so a tokenbus wave started within
that second ran its first requests beside a core-hungry process that production does
not have (the worker leg of each round's first c=1 request was 125 to 238 ms against 18
to 25 at p50)."""
STACK_SERVICES_ON_PATH = ("broker", "stream_job", "billing", "worker-0")


@dataclass
class ArmWaves:
    """Every measured wave of one arm at one concurrency, across rounds."""

    waves: list[WaveResult] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)

    def traces(self) -> list[RequestTrace]:
        return [t for w in self.waves for t in w.traces]


@dataclass
class TokenbusArm:
    stack: Stack
    client: TokenbusClient
    max_tokens: int
    request_ids: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """request_id --> (round, concurrency, prompt index), to join billing's timings."""

    async def wave(
        self, round_index: int, texts: list[str], concurrency: int, on_done: Any
    ) -> WaveResult:
        sampling = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)

        async def stream(index: int, text: str) -> AsyncIterator[int]:
            request = await self.client.submit(tenant_id=TENANT, prompt=text, sampling=sampling)
            self.request_ids[request.request_id] = (round_index, concurrency, index)
            async for chunk in self.client.stream(request):
                if chunk.error is not None:
                    raise RequestFailed(chunk.error)
                yield chunk.num_tokens

        return await run_wave(stream, texts, concurrency, on_done)


def stack_meter(stack: Stack) -> CpuMeter:
    pids = {service.name: service.process.pid for service in stack.services}
    worker = pids["worker-0"]
    return CpuMeter(
        {
            "broker": [pids["broker"]],
            "stream_job": [pids["stream_job"]],
            "billing": [pids["billing"]],
            "worker_process": [worker],
            "engine": descendants(worker),
            # Started by the stack but not on the TokenbusClient path: reported, not summed.
            "other_services": [
                pid for name, pid in pids.items() if name not in STACK_SERVICES_ON_PATH
            ],
        }
    )


class WaveProfiles:
    """py-spy on tokenbus's own processes (the job, the worker process, billing, and this
    client) during the tokenbus arm's waves only, one profile per process and
    concurrency, pooled over the rounds: where the CPU per token of the split goes."""

    PARTS = ("stream_job", "worker_process", "billing", "client")

    def __init__(self, stack: Stack, directory: Path) -> None:
        pids = {service.name: service.process.pid for service in stack.services}
        self._pids = {
            "stream_job": pids["stream_job"],
            "worker_process": pids["worker-0"],
            "billing": pids["billing"],
            "client": os.getpid(),
        }
        self._directory = directory
        self._raw: dict[tuple[str, int], list[Path]] = {}
        self._running: list[Profiler] = []

    def start(self, round_index: int, concurrency: int) -> None:
        for part, pid in self._pids.items():
            out = self._directory / f"{part}-c{concurrency}-r{round_index}.txt"
            self._raw.setdefault((part, concurrency), []).append(out)
            self._running.append(Profiler(pid, out))

    def stop(self) -> None:
        for profiler in self._running:
            profiler.stop()
        self._running.clear()

    def summary(self) -> dict[str, dict[str, Any]]:
        """``{"c=64": {"stream_job": top_frames, ...}, ...}``."""
        summary: dict[str, dict[str, Any]] = {}
        for (part, concurrency), raws in self._raw.items():
            merged = merge_raw(raws, self._directory / f"{part}-c{concurrency}.txt")
            summary.setdefault(f"c={concurrency}", {})[part] = top_frames(merged, num_frames=20)
        return summary


def broker_pid(stack: Stack) -> int:
    return next(s.process.pid for s in stack.services if s.name == "broker")


def billing_timings(
    settings: Settings, expected: int, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Per-request timings the worker reported, read back through the billing sink."""
    sql = (
        "SELECT request_id, queue_ms, ttft_ms, total_ms, completion_tokens "
        "FROM usage_events FINAL WHERE tenant_id = {tenant:String}"
    )
    return _query_rows(settings, sql, expected, timeout_s)


PATH_SPANS = ("job.admit", "job.queue", "bus.dispatch", *PATH_PHASES)
"""The spans on a request's path to its first token that the stack's services store
(``tokenbus.span_path``): the job's admission and queue, the hop from the job to the
worker, and the worker's phases from taking the record to sending the first reply. The
client's hop to the job and the reply's hop to the client are what the legs add beside
them."""

PATH_PARTS = {
    "job": ("job.admit", "job.queue"),
    "worker_own": ("worker.intake", "worker.emit"),
}
"""Sums per request of ``PATH_SPANS``: the job's own part of the path, and the worker's
less the engine's input processing, queue and prefill (the direct arm's TTFT holds those
too; ``worker.emit`` holds vLLM's output processing, which it holds as well)."""


def path_spans(settings: Settings, expected: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Each request's ``PATH_SPANS`` (trace id, request id, name, µs), read back through
    the billing query server from the spans the stack's services stored; none with
    tracing off (``--set trace_sample_ratio=0``). A run that keeps a share of its traces
    waits ``timeout_s`` for spans that will not come, then takes what there is."""
    if settings.trace_sample_ratio == 0:
        return []
    names = ", ".join(f"'{name}'" for name in PATH_SPANS)
    sql = (
        "SELECT trace_id, request_id, name, duration_us FROM spans FINAL "
        f"WHERE tenant_id = {{tenant:String}} AND name IN ({names})"
    )
    return _query_rows(settings, sql, expected * len(PATH_SPANS), timeout_s)


def _query_rows(
    settings: Settings, sql: str, expected: int, timeout_s: float
) -> list[dict[str, Any]]:
    """The rows of ``sql`` (on this benchmark's tenant), once there are ``expected`` of
    them or ``timeout_s`` has passed: the sinks write what the services sent a moment
    after it."""
    body = json.dumps({"sql": sql, "parameters": {"tenant": TENANT}}).encode()
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            f"http://127.0.0.1:{settings.billing_query_port}/query", data=body, method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            rows = json.loads(response.read())["rows"]
        if len(rows) >= expected:
            break
        time.sleep(0.5)
    return rows


def wave_sizes(concurrency: int, args: argparse.Namespace) -> int:
    return max(int(args.min_requests), concurrency * int(args.requests_per_lane))


SEAT_RESERVE = 0.0
"""The stack's ``vip_reserve`` in this benchmark, unless ``--set`` names it. The direct
arm puts every request of a wave into the engine; so does the tokenbus arm, so both
run the engine at the same concurrency. On the default (0.3) the job keeps 30% of the
seats for class 0, which this benchmark never sends: at c=64 its class 1 requests ran
45 at a time against the direct arm's 64, and the comparison measured that policy (the
engine's own CPU per token was 1.5 times the direct arm's, tokenbus's nearly twice,
its idle polling spread over fewer tokens a second). ``--set vip_reserve=0.3`` measures
the default; ``make timing`` measures what the reserve is for."""


def stack_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The Settings fields this run sets on the stack: ``SEAT_RESERVE``, then ``--set``."""
    return {"vip_reserve": SEAT_RESERVE, **parse_overrides(args.set)}


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    settings = bench_settings(model_path=model_dir(), **stack_overrides(args))
    (settings.home / "logs").mkdir(parents=True, exist_ok=True)
    console.print(f"[dim]TOKENBUS_HOME={settings.home}  load {load_start['load_1_5_15']}[/]")

    direct = DirectProcess(settings, settings.home / "logs" / "direct.log")
    stack = Stack(settings, on_progress=lambda m: console.print(f"[dim]stack: {m}[/]"))
    results: dict[tuple[str, int], ArmWaves] = {}
    idle_stack_cores: list[float] = []
    idle_s_total = 0.0  # the direct arm's waves, end to end
    idle_cpu: dict[str, float] = dict.fromkeys(IDLE_PARTS, 0.0)  # the stack's CPU meanwhile
    try:
        await stack.start()
        if args.pin_job:  # every thread the job has by now; later ones inherit the mask
            pin_threads(stack.pid("stream_job"), args.pin_job)
        await direct.ready()
        meter = stack_meter(stack)
        profiles = WaveProfiles(stack, settings.home / "profiles") if args.profile else None
        client_settings = settings.model_copy(update=parse_overrides(args.client_set))
        async with TokenbusClient(client_settings) as client:
            tokenbus = TokenbusArm(stack, client, args.max_tokens)
            with progress(console) as bar:
                waves_task = bar.add_task(
                    "waves", total=2 * (1 + args.rounds * len(args.concurrency))
                )
                # Warm-up: first requests pay one-off costs (allocations, group joins).
                warm = prompts(WARMUP_ROUND, 16)
                await direct.wave(warm, 8, args.max_tokens, TENANT)
                bar.advance(waves_task)
                await tokenbus.wave(WARMUP_ROUND, warm, 8, None)
                bar.advance(waves_task)
                for round_index in range(args.rounds):
                    for concurrency in args.concurrency:
                        texts = prompts(round_index, wave_sizes(concurrency, args))
                        order = (
                            ("direct", "tokenbus")
                            if round_index % 2 == 0
                            else ("tokenbus", "direct")
                        )
                        for arm in order:
                            await asyncio.sleep(ARM_SETTLE_S)
                            task = bar.add_task(
                                f"r{round_index} {arm} c={concurrency}", total=len(texts)
                            )
                            slot = results.setdefault((arm, concurrency), ArmWaves())
                            meter.start()
                            wall = time.perf_counter()
                            cpu_client = time.process_time()
                            system_client = os.times().system
                            wait_client = runqueue_wait_seconds(os.getpid())
                            runs_client = times_scheduled(os.getpid())
                            writes_client = write_syscalls(os.getpid())
                            if arm == "direct":
                                reply = await direct.wave(
                                    texts, concurrency, args.max_tokens, TENANT
                                )
                                wave = WaveResult.from_json(reply["wave"])
                                cpu = {f"direct_{k}": v for k, v in reply["cpu"].items()}
                                stack_cpu = meter.delta()
                                idle_s = time.perf_counter() - wall
                                idle_stack_cores.append(
                                    sum(
                                        v
                                        for k, v in stack_cpu.items()
                                        if k not in ("engine", "other_services")
                                    )
                                    / idle_s
                                )
                                idle_s_total += idle_s
                                for part in idle_cpu:
                                    idle_cpu[part] += stack_cpu.get(part, 0.0)
                                bar.update(task, completed=len(texts))
                            else:
                                if profiles is not None:
                                    profiles.start(round_index, concurrency)
                                wave = await tokenbus.wave(
                                    round_index,
                                    texts,
                                    concurrency,
                                    lambda _t, task=task: bar.advance(task),
                                )
                                if profiles is not None:
                                    profiles.stop()
                                waits = meter.wait_delta()
                                waits["client"] = runqueue_wait_seconds(os.getpid()) - wait_client
                                runs = meter.runs_delta()
                                runs["client"] = times_scheduled(os.getpid()) - runs_client
                                writes = meter.writes_delta()
                                writes["client"] = write_syscalls(os.getpid()) - writes_client
                                system = {
                                    **meter.system_delta(),
                                    "client": os.times().system - system_client,
                                }
                                cpu = {
                                    **meter.delta(),
                                    "client": round(time.process_time() - cpu_client, 3),
                                    **{f"{k}_system": round(v, 3) for k, v in system.items()},
                                    **{f"{k}_runqueue_wait": round(v, 3) for k, v in waits.items()},
                                    **{f"{k}_runs": v for k, v in runs.items()},
                                    **{f"{k}_writes": v for k, v in writes.items()},
                                }
                            slot.waves.append(wave)
                            slot.cpu.append(cpu)
                            bar.remove_task(task)
                            bar.advance(waves_task)
                            stack.check()
        expected = len(tokenbus.request_ids)
        timings = await asyncio.to_thread(billing_timings, settings, expected)
        spans = await asyncio.to_thread(path_spans, settings, expected)
        # The floor the TTFT legs stand on: one hop through this stack's broker, now.
        floor = (
            await hop_floor(settings, broker_pid(stack), args.hop_messages)
            if args.hop_messages
            else None
        )
        profiled = profiles.summary() if profiles is not None else None
    finally:
        if profiles is not None:
            profiles.stop()
        direct.stop()
        stack.stop()
    load_end = uptime_load()
    if not args.keep:
        shutil.rmtree(settings.home, ignore_errors=True)
    result = summarize_run(
        args,
        results,
        tokenbus.request_ids,
        timings,
        idle_stack_cores,
        load_start,
        load_end,
        {IDLE_PARTS[part]: cpu / idle_s_total for part, cpu in idle_cpu.items()}
        if idle_s_total
        else None,
        spans,
    )
    return {**result, "hop_floor": floor, **({"profiles": profiled} if profiled else {})}


IDLE_PARTS = {
    "stream_job": "stream_job",
    "worker_process": "worker_loop",
    "billing": "billing",
    "broker": "broker",
}
"""The stack's processes whose idle cores are measured: ``CpuMeter`` name --> the name
the per-token split uses. The client is this process, busy driving the direct arm
meanwhile."""


SYSTEM_SHARE_PARTS = {
    "stream_job": "stream_job",
    "worker_loop": "worker_process",
    "client": "client",
    "billing": "billing",
    "broker": "broker",
}
"""The per-token split's parts --> the CPU counter whose kernel share stands for each."""

COUNTED_PARTS = ("stream_job", "worker_process", "engine", "client", "billing", "broker")
"""The processes whose times on a CPU and write system calls are counted per token: the
worker's whole process (its Kafka loop and the engine's front end) and the engine core
apart."""


def summarize_run(
    args: argparse.Namespace,
    results: dict[tuple[str, int], ArmWaves],
    request_ids: dict[str, tuple[int, int, int]],
    timings: list[dict[str, Any]],
    idle_stack_cores: list[float],
    load_start: dict[str, Any],
    load_end: dict[str, Any],
    idle_cores: dict[str, float] | None = None,
    spans: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``idle_cores``: each stack process's cores (named as in ``IDLE_PARTS``) while the
    direct arm ran its waves and the tokenbus arm stood idle (its polling and timers),
    pooled over all those waves: ``/proc`` counts CPU in 10 ms ticks, too coarse for one
    wave of an idle process. ``spans``: ``path_spans``' rows."""
    by_request = {row["request_id"]: row for row in timings}
    rows: list[dict[str, Any]] = []
    for concurrency in args.concurrency:
        direct, bus = results[("direct", concurrency)], results[("tokenbus", concurrency)]
        d = WaveResult(concurrency, sum(w.wall_s for w in direct.waves), direct.traces()).summary()
        t = WaveResult(concurrency, sum(w.wall_s for w in bus.waves), bus.traces()).summary()
        cpu_bus = {k: round(sum(c.get(k, 0.0) for c in bus.cpu), 3) for k in bus.cpu[0]}
        cpu_direct = {k: round(sum(c.get(k, 0.0) for c in direct.cpu), 3) for k in direct.cpu[0]}
        legs = request_legs(bus, request_ids, by_request, concurrency)
        spans_of = spans_by_request(spans or [], request_ids, concurrency)
        worker_loop = cpu_bus["worker_process"] - cpu_direct["direct_frontend"]
        pipeline = (
            cpu_bus["broker"] + cpu_bus["stream_job"] + cpu_bus["billing"] + cpu_bus["client"]
            + worker_loop
        )  # fmt: skip
        rows.append(
            {
                "concurrency": concurrency,
                "direct": d,
                "tokenbus": t,
                "added_ttft_ms": added_ttft_ms(t["ttft_ms"], d["ttft_ms"]),
                "ratios": {
                    "ttft_p50": ratio(t["ttft_ms"]["p50"], d["ttft_ms"]["p50"]),
                    "ttft_p99": ratio(t["ttft_ms"]["p99"], d["ttft_ms"]["p99"]),
                    "itl_p50": ratio(t["itl_ms"]["p50"], d["itl_ms"]["p50"]),
                    "itl_p99": ratio(t["itl_ms"]["p99"], d["itl_ms"]["p99"]),
                    "throughput": ratio(t["tokens_per_s"], d["tokens_per_s"]),
                },
                "cpu_s": {"tokenbus": cpu_bus, "direct": cpu_direct},
                "pipeline_cpu_s": round(pipeline, 3),
                "pipeline_cpu_s_per_1k_tokens": round(1000 * pipeline / max(1, t["num_tokens"]), 4),
                "pipeline_cpu_s_per_1k_tokens_by_part": {
                    part: round(1000 * value / max(1, t["num_tokens"]), 4)
                    for part, value in {
                        "broker": cpu_bus["broker"],
                        "stream_job": cpu_bus["stream_job"],
                        "billing": cpu_bus["billing"],
                        "client": cpu_bus["client"],
                        "worker_loop": worker_loop,
                    }.items()
                },
                # The same split in µs of CPU per token, per process.
                "us_cpu_per_token_by_process": {
                    part: round(1e6 * value / max(1, t["num_tokens"]), 2)
                    for part, value in {
                        "stream_job": cpu_bus["stream_job"],
                        "worker_loop": worker_loop,
                        "client": cpu_bus["client"],
                        "billing": cpu_bus["billing"],
                        "broker": cpu_bus["broker"],
                    }.items()
                },
                # How often each process's threads were put on a CPU, per token: about
                # one per wakeup, whose cost is the machine's (bench.machine). The
                # worker's count is its whole process, the engine's front end with it.
                # Write system calls per token, likewise: mostly each process's requests to
                # the broker (a fetch or a produce each) and its wakeups of its own threads.
                **{
                    f"{counter}_per_token_by_process": {
                        part: round(cpu_bus[f"{part}_{counter}"] / max(1, t["num_tokens"]), 3)
                        for part in COUNTED_PARTS
                        if f"{part}_{counter}" in cpu_bus
                    }
                    for counter in ("runs", "writes")
                },
                # How much of each process's CPU in these waves the kernel spent (system
                # calls, page faults); the worker's is its whole process, front end and all.
                "system_share_by_process": {
                    part: round(cpu_bus.get(f"{name}_system", 0.0) / cpu_bus[name], 3)
                    for part, name in SYSTEM_SHARE_PARTS.items()
                    if cpu_bus.get(name)
                },
                # What the same processes spend idle, over this wave's time and tokens:
                # the share of the figure above that is polling, not work.
                "us_cpu_per_token_idle_by_process": {
                    part: round(1e6 * cores * t["wall_s"] / max(1, t["num_tokens"]), 2)
                    for part, cores in (idle_cores or {}).items()
                },
                "ttft_breakdown_ms": ttft_breakdown(legs),
                "path_spans_ms": path_breakdown(spans_of),
                "slowest_ttft_ms": slowest(legs),
                "requests_ms": request_rows(legs, spans_of),
                # Summed over threads: how long each process sat runnable without a core.
                "runqueue_wait_ms_per_request": {
                    arm: {
                        k.removesuffix("_runqueue_wait"): round(1000 * v / max(1, n), 2)
                        for k, v in cpu.items()
                        if k.endswith("_runqueue_wait")
                    }
                    for arm, cpu, n in (
                        ("tokenbus", cpu_bus, t["num_requests"]),
                        ("direct", cpu_direct, d["num_requests"]),
                    )
                },
            }
        )
    return {
        "command": "python -m bench.overhead " + " ".join(args.argv),
        "parameters": {
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "requests_per_wave": {c: wave_sizes(c, args) for c in args.concurrency},
            "settings_overrides": parse_overrides(args.set),
            "client_overrides": parse_overrides(args.client_set),
            "job_cpus": sorted(args.pin_job) or None,
            "vip_reserve": float(stack_overrides(args)["vip_reserve"]),
            "sampling": "temperature 0, ignore_eos, fixed max_tokens; ~150-token unique prompts",
        },
        "load_start": load_start,
        "load_end": load_end,
        "idle_stack_cores_during_direct": summarize(idle_stack_cores),
        "idle_cores_by_process_during_direct": {
            part: round(cores, 4) for part, cores in (idle_cores or {}).items()
        },
        "num_billed": len(timings),
        "num_sent": len(request_ids),
        "results": rows,
    }


def request_legs(
    bus: ArmWaves,
    request_ids: dict[str, tuple[int, int, int]],
    by_request: dict[str, dict[str, Any]],
    concurrency: int,
) -> list[dict[str, Any]]:
    """Each request of the bus arm at ``concurrency`` with its TTFT split by the worker's
    own timestamps (from its UsageEvent): client --> job dispatched is ``queue_ms``;
    dispatched --> first token at the worker ``ttft_ms - queue_ms``; the worker's first
    token --> client the client's TTFT less ``ttft_ms``. In wave order."""
    index = {(r, c, i): rid for rid, (r, c, i) in request_ids.items() if c == concurrency}
    legs: list[dict[str, Any]] = []
    for round_index, wave in enumerate(bus.waves):
        for trace in wave.traces:
            rid = index.get((round_index, concurrency, trace.index))
            row = by_request.get(rid or "")
            if row is None or trace.ttft_s is None or row["ttft_ms"] is None:
                continue
            legs.append(
                {
                    "request_id": rid,
                    "round": round_index,
                    "index": trace.index,
                    "ttft": round(trace.ttft_s * 1000, 2),
                    "client_to_dispatched": row["queue_ms"],
                    "dispatched_to_worker_first_token": row["ttft_ms"] - row["queue_ms"],
                    "worker_first_token_to_client": trace.ttft_s * 1000 - row["ttft_ms"],
                }
            )
    return legs


LEGS = ("client_to_dispatched", "dispatched_to_worker_first_token", "worker_first_token_to_client")


def ttft_breakdown(legs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each leg's percentiles over the requests of one concurrency."""
    return {leg: summarize([request[leg] for request in legs]) for leg in LEGS}


def path_breakdown(by_request: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Each of ``PATH_SPANS``' percentiles in ms over the requests of
    ``spans_by_request``, then each of ``PATH_PARTS`` over the requests that have all its
    spans; a span no request of it has is left out."""
    out: dict[str, Any] = {}
    for name in PATH_SPANS:
        values = [ms[name] for ms in by_request.values() if name in ms]
        if values:
            out[name] = summarize(values)
    for part, names in PATH_PARTS.items():
        sums = [sum(ms[n] for n in names) for ms in by_request.values() if set(names) <= ms.keys()]
        if sums:
            out[part] = summarize(sums)
    return out


def spans_by_request(
    spans: list[dict[str, Any]],
    request_ids: dict[str, tuple[int, int, int]],
    concurrency: int,
) -> dict[str, dict[str, float]]:
    """Request id --> its ``PATH_SPANS`` in ms, for the measured requests (not the
    warm-up's) at ``concurrency``. A hop span names no request: its trace's other spans
    do."""
    measured = {
        rid for rid, (round_index, c, _) in request_ids.items()
        if c == concurrency and round_index >= 0
    }  # fmt: skip
    traces = {row["trace_id"]: row["request_id"] for row in spans if row["request_id"]}
    by_request: dict[str, dict[str, float]] = {}
    for row in spans:
        request_id = row["request_id"] or traces.get(row["trace_id"])
        if request_id in measured:
            by_request.setdefault(request_id, {})[row["name"]] = row["duration_us"] / 1000
    return by_request


def slowest(legs: list[dict[str, Any]], n: int = 3) -> list[dict[str, Any]]:
    """The ``n`` requests with the longest TTFT, each with where it was in its wave (the
    tail's requests: the first of a wave, or anywhere) and its legs, ms."""
    worst = sorted(legs, key=lambda request: -request["ttft"])[:n]
    return [{k: v for k, v in rounded(request).items() if k != "request_id"} for request in worst]


def rounded(leg: dict[str, Any]) -> dict[str, Any]:
    """A request's legs with their ms to two decimals."""
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in leg.items()}


def request_rows(
    legs: list[dict[str, Any]], by_request: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """Every request's legs and path spans, ms, in wave order: what the percentiles
    summarize, kept for a look at a distribution's shape (two modes, a slow round)."""
    return [
        {
            **rounded(leg),
            "spans": {
                name: round(ms, 3) for name, ms in by_request.get(leg["request_id"], {}).items()
            },
        }
        for leg in legs
    ]


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title="tokenbus vs direct vLLM (tiny model)")
    for column in (
        "conc",
        "TTFT p50 direct/bus ms",
        "TTFT p99 direct/bus ms",
        "added TTFT p50/p99 ms",
        "ITL p50 direct/bus ms",
        "ITL p99 direct/bus ms",
        "tok/s direct/bus",
        "thr. ratio",
        "pipeline CPU s/1k tok",
    ):
        table.add_column(column, justify="right")
    for row in result["results"]:
        d, t = row["direct"], row["tokenbus"]
        table.add_row(
            str(row["concurrency"]),
            f"{d['ttft_ms']['p50']:.1f} / {t['ttft_ms']['p50']:.1f}",
            f"{d['ttft_ms']['p99']:.1f} / {t['ttft_ms']['p99']:.1f}",
            f"{row['added_ttft_ms']['p50']:.1f} / {row['added_ttft_ms']['p99']:.1f}",
            f"{d['itl_ms']['p50']:.2f} / {t['itl_ms']['p50']:.2f}",
            f"{d['itl_ms']['p99']:.2f} / {t['itl_ms']['p99']:.2f}",
            f"{d['tokens_per_s']:.0f} / {t['tokens_per_s']:.0f}",
            f"{row['ratios']['throughput']:.3f}",
            f"{row['pipeline_cpu_s_per_1k_tokens']:.3f}",
        )
    console.print(table)
    breakdown = Table(title="tokenbus TTFT split by the worker's timestamps (p50 ms)")
    for column in ("conc", "client->dispatched", "dispatched->worker token", "worker->client"):
        breakdown.add_column(column, justify="right")
    for row in result["results"]:
        b = row["ttft_breakdown_ms"]
        breakdown.add_row(
            str(row["concurrency"]),
            *(str(b[k].get("p50", "-")) for k in b),
        )
    console.print(breakdown)
    rows = result["results"]
    names = [n for n in PATH_SPANS if any(n in r.get("path_spans_ms", {}) for r in rows)]
    if names:
        path = Table(title="the stack's spans on the path to a first token (p50 ms)")
        for column in ("conc", *names):
            path.add_column(column, justify="right")
        for row in rows:
            spans = row["path_spans_ms"]
            path.add_row(
                str(row["concurrency"]),
                *(f"{spans[name]['p50']:.2f}" if name in spans else "-" for name in names),
            )
        console.print(path)
    for row in result["results"]:
        for request in row.get("slowest_ttft_ms", []):
            console.print(
                f"c={row['concurrency']} slow: round {request['round']} request "
                f"{request['index']}: TTFT {request['ttft']} ms = "
                + " + ".join(str(request[leg]) for leg in LEGS)
            )
    split = Table(title="µs of CPU per token, by process")
    for column in ("conc", "job", "worker loop", "client", "billing", "broker"):
        split.add_column(column, justify="right")
    for row in result["results"]:
        us = row["us_cpu_per_token_by_process"]
        split.add_row(str(row["concurrency"]), *(f"{v:.1f}" for v in us.values()))
        idle = row.get("us_cpu_per_token_idle_by_process") or {}
        if idle:  # the same processes idle, over this wave's time and tokens
            split.add_row(
                f"{row['concurrency']}, of it idle",
                *(f"{idle[part]:.1f}" if part in idle else "-" for part in us),
            )
        kernel = row.get("system_share_by_process") or {}
        if kernel:  # the kernel's share of each process's CPU in these waves
            split.add_row(
                f"{row['concurrency']}, kernel %",
                *(f"{100 * kernel[part]:.0f}%" if part in kernel else "-" for part in us),
            )
        # Times on a CPU per token (about one per wakeup) and write system calls per token
        # (requests to the broker, mostly); the worker loop's are its whole process's.
        for counter in ("runs", "writes"):
            counts = row.get(f"{counter}_per_token_by_process") or {}
            if counts:
                named = {**counts, "worker_loop": counts.get("worker_process")}
                split.add_row(
                    f"{row['concurrency']}, {counter} per token",
                    *(f"{named[part]:.3f}" if named.get(part) is not None else "-" for part in us),
                )
    console.print(split)
    floor = result.get("hop_floor")
    if floor:
        console.print(
            f"one hop through this stack's broker (fetch_max_wait_ms "
            f"{floor['fetch_max_wait_ms']}): p50 {floor['hop_ms']['p50']} ms, "
            f"p99 {floor['hop_ms']['p99']} ms"
            + (
                f"; lock-step in one process p50 {floor['hop_in_process_ms']['p50']} ms"
                if "hop_in_process_ms" in floor
                else ""
            )
        )
    console.print(
        f"load {result['load_start']['load_1_5_15']} -> {result['load_end']['load_1_5_15']}; "
        f"billed {result['num_billed']}/{result['num_sent']}"
    )
    for concurrency, parts in (result.get("profiles") or {}).items():
        for part, profile in parts.items():
            print_profile(profile, console, f"{concurrency}, {part}")


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--min-requests",
        type=int,
        default=MIN_REQUESTS,
        help="per wave (default %(default)s: see MIN_REQUESTS)",
    )
    parser.add_argument("--requests-per-lane", type=int, default=2, help="per wave")
    parser.add_argument("--name", help="result file name (default: overhead, or overhead-profile)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the job, the worker process, billing and the client in the tokenbus "
        "waves (slows them: the run's CPU figures are not the goals')",
    )
    parser.add_argument(
        "--hop-messages", type=int, default=100, help="hops through the stack's broker (0: none)"
    )
    add_pin_job_arg(parser)
    add_settings_args(parser)
    parser.add_argument(
        "--client-set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a Settings field for the benchmark's own TokenbusClient only (the "
        "stack keeps --set's), e.g. --client-set fetch_max_wait_ms=2",
    )
    run_benchmark(parser, argv, measure, render, profiled_name("overhead"))


if __name__ == "__main__":
    main()
