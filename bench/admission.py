"""Stage: admission through the Faust job, in requests/s per core of the job's process.

    .venvs/stream/bin/python -m bench.admission [--requests 20000] [--profile]

A broker and the real Faust job (``python -m stream_jobs``), and pretend workers that
only send heartbeats. The benchmark produces a burst of InferenceRequests as fast as it
can and counts what the job forwards to the pretend workers' topics. Each record is
produced as a tokenbus service produces it: keyed by its tenant, with a service token
(one per tenant, minted before the clock starts, as the bridge reuses its tokens) in
its ``authorization`` header, naming the benchmark's own reply topic. The job counts
each prompt with the served model's tokenizer (the tiny model's, built once), as it
does in production, unless the record carries the bridge's vouched count
(``tokenbus.prompt_vouch``): ``--counted-by bridge`` (the default) sends each record as
the bridge does, with the count the bridge made for its own checks; ``--counted-by
job`` sends it as a program's client does, and the job counts every prompt. Per core means
requests divided by the CPU seconds the job's process spent (all its threads), so the
figure does not depend on what else the shared machine is doing; wall-clock rate is
reported beside it.

``--pin-job CPU`` runs the job's threads on that CPU alone (``taskset -a``), once it is
up: its event loop and Faust's consumer thread then hand work to each other on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

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
from bench.pretend import ForwardCounter, heartbeat_loop, pretend_ids
from bench.procstat import CpuMeter, pin_threads, thread_cpu_seconds, threads_split
from bench.profile import Profiler, top_frames
from bench.report import RESULTS_DIR, uptime_load
from bench.services import start_job
from bench.stats import summarize
from bench.workload import prompt, tenant
from schemas import InferenceRequest, SamplingParams, encode
from tokenbus.config import Settings
from tokenbus.kafka import make_producer
from tokenbus.prompt_tokens import PromptCounter
from tokenbus.prompt_vouch import HEADER as VOUCH_HEADER
from tokenbus.prompt_vouch import vouch
from tokenbus.topics import Topics
from tokenbus_cli.stack import Stack

GOAL_PER_CORE = 5_000
Headers = list[tuple[str, bytes]]
JobStarter = Callable[[Stack, str], Awaitable[None]]


def reply_topic(settings: Settings) -> str:
    """The benchmark's reply topic (rejections, duplicates): a reply topic of the stack's,
    which the service tokens below name as theirs."""
    return Topics(settings.topic_prefix).replies("bench-admission")


class Credentials:
    """The ``authorization`` header of each tenant's records: a service token under the
    stack's secret, owning the benchmark's reply topic (see ``tokenbus.auth``)."""

    def __init__(self, settings: Settings) -> None:
        from tokenbus.auth import ServiceTokens  # PyJWT: the stream environment only

        assert settings.bus_service_secret, "bench_settings gives every stack a secret"
        self.secret = settings.bus_service_secret
        self._tokens = ServiceTokens(settings.bus_service_secret, ttl_s=3600)
        self._reply_topic = reply_topic(settings)
        self._headers: dict[str, Headers] = {}

    def headers(self, tenant_id: str) -> Headers:
        headers = self._headers.get(tenant_id)
        if headers is None:
            token = self._tokens.token(tenant_id, self._reply_topic)
            headers = self._headers[tenant_id] = [("authorization", f"Bearer {token}".encode())]
        return headers


def bridge_count(settings: Settings, prompt_tokens: int) -> int:
    """The prompt's count as the bridge makes it, for its 413 and the token's balance,
    with the same tokenizer and rule as the job's (every record has the same prompt)."""
    counter = PromptCounter.from_model_dir(settings.model_dir)
    assert counter.exact, f"no tokenizer in {settings.model_dir}"
    return counter.count_prompt(prompt(0, 0, prompt_tokens))


def build_requests(
    num_requests: int,
    num_tenants: int,
    prompt_tokens: int,
    model: str,
    reply_to: str,
    credentials: Credentials,
    vouched_count: int | None = None,
) -> list[tuple[str, bytes, Headers]]:
    """(tenant, encoded request, headers), built before the clock starts. Ids are unique
    within a run, and each run has a stack of its own (the job runs each (tenant,
    request id) once). ``vouched_count``: the prompt's count, vouched for on each record
    as the bridge's client does; None: none, as a program's client sends it."""
    text = prompt(0, 0, prompt_tokens)
    out: list[tuple[str, bytes, Headers]] = []
    for i in range(num_requests):
        tenant_id = tenant(i % num_tenants)
        request = InferenceRequest(
            request_id=f"req_bench{i:09d}",
            session_id=f"sess_bench{i:09d}",
            tenant_id=tenant_id,
            model=model,
            prompt=text,
            sampling=SamplingParams(max_tokens=64, ignore_eos=True),
            reply_to=reply_to,
            created_at=datetime.now(UTC),
        )
        value, headers = encode(request), credentials.headers(tenant_id)
        if vouched_count is not None:
            headers = [*headers, (VOUCH_HEADER, vouch(credentials.secret, value, vouched_count))]
        out.append((tenant_id, value, headers))
    return out


async def run_admission(
    *,
    num_requests: int = 20_000,
    num_tenants: int = 10,
    num_workers: int = 1,
    prompt_tokens: int = 150,
    overrides: dict[str, Any] | None = None,
    profile_to: Path | None = None,
    num_latency_probes: int = 100,
    on_progress: Callable[[int], None] = lambda n: None,
    job: JobStarter | None = None,
    counted_by: str = "bridge",
    pin_job: Sequence[int] = (),
) -> dict[str, Any]:
    """``job`` starts what admits, as ``stream_job``, forwarding to the topic it is given
    (``bench.faust_floor``); by default the Faust job itself. ``pin_job``: the CPUs its
    threads are pinned to once it forwards (none: where the kernel puts them)."""
    # The served model's tokenizer, as in production: the job counts each prompt's
    # tokens with it for the quota's reservation.
    settings = bench_settings(model_path=model_dir(), **(overrides or {}))
    topics = Topics(settings.topic_prefix)
    replies = reply_topic(settings)
    credentials = Credentials(settings)
    workers = pretend_ids(num_workers)
    stack = Stack(settings)
    # The burst's producer batches (it stands for many producers at once); the idle
    # probes go through one with the settings' linger (0), as a client's do, so that no
    # linger of the benchmark's own is counted as the job's latency.
    producer = make_producer(settings, linger_ms=5, max_batch_size=256 * 1024)
    probe_producer = make_producer(settings)
    counter = ForwardCounter(settings, workers)
    beats: asyncio.Task[None] | None = None
    try:
        await stack.start_broker({replies: 1, **{topics.worker(w): 1 for w in workers}})
        await producer.start()
        await probe_producer.start()
        beats = asyncio.create_task(heartbeat_loop(settings, producer, workers))
        await (job or _the_job)(stack, topics.worker(workers[0]))
        await counter.start()
        await _probe(settings, producer, counter, credentials)
        if pin_job:  # every thread the job has by now; later ones inherit the mask
            pin_threads(stack.pid("stream_job"), pin_job)
        latency_ms, legs_ms = await _idle_latency(
            settings, probe_producer, counter, credentials, num_latency_probes
        )
        vouched_count = bridge_count(settings, prompt_tokens) if counted_by == "bridge" else None
        payload = build_requests(
            num_requests,
            num_tenants,
            prompt_tokens,
            settings.served_model_name,
            replies,
            credentials,
            vouched_count,
        )
        base = counter.num_forwarded
        meter = CpuMeter({"stream_job": [stack.pid("stream_job")], "broker": [stack.pid("broker")]})
        profiler = Profiler(stack.pid("stream_job"), profile_to) if profile_to else None
        meter.start()
        threads_before = thread_cpu_seconds(stack.pid("stream_job"))
        started = time.perf_counter()
        sends = [
            await producer.send(topics.requests(1), value, key=tenant_id.encode(), headers=headers)
            for tenant_id, value, headers in payload
        ]
        await asyncio.gather(*sends)
        produced_s = time.perf_counter() - started
        while not await counter.wait_for(base + num_requests, timeout_s=0.5):
            on_progress(counter.num_forwarded - base)
            if time.perf_counter() - started > 60 + num_requests / 200:
                break
        on_progress(counter.num_forwarded - base)
        cpu = meter.delta()
        # The job's CPU by thread: its event loop's against Faust's consumer thread (and
        # any other), which py-spy's samples cannot tell apart from waiting for the GIL.
        job_threads = threads_split(
            stack.pid("stream_job"), threads_before, thread_cpu_seconds(stack.pid("stream_job"))
        )
        profile = top_frames(profiler.stop()) if profiler else None
        num_forwarded = counter.num_forwarded - base
        wall_s = max(1e-9, counter.last_at - started)
    finally:
        if beats is not None:
            beats.cancel()
        await counter.stop()
        await producer.stop()
        await probe_producer.stop()
        stack.stop()
        shutil.rmtree(settings.home, ignore_errors=True)
    return {
        "num_requests": num_requests,
        "num_forwarded": num_forwarded,
        "num_tenants": num_tenants,
        "num_workers": num_workers,
        "prompt_tokens": prompt_tokens,
        "counted_by": counted_by,
        "job_cpus": sorted(pin_job) or None,
        "request_bytes": round(sum(len(v) for _, v, _ in payload) / len(payload)),
        "header_bytes": round(
            sum(len(k) + len(v) for _, _, hs in payload for k, v in hs) / len(payload)
        ),
        "by_worker": dict(counter.by_worker),
        "produce_s": round(produced_s, 3),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(num_forwarded / wall_s, 1),
        "idle_latency_ms": latency_ms,
        "idle_legs_ms": legs_ms,
        "cpu_s": cpu,
        "job_cpu_s_by_thread": job_threads,
        "requests_per_core_s": round(num_forwarded / max(1e-9, cpu["stream_job"]), 1),
        "broker_cpu_ms_per_1k": round(1e6 * cpu["broker"] / max(1, num_forwarded), 2),
        "profile": profile,
    }


async def _the_job(stack: Stack, forward_to: str) -> None:
    await start_job(stack)  # it finds the workers' topics by their heartbeats


async def _idle_latency(
    settings: Any,
    producer: Any,
    counter: ForwardCounter,
    credentials: Credentials,
    num_probes: int,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """One request at a time: produce --> job --> pretend worker's topic, at idle.

    This is the job's added latency with nothing queued: two broker hops and the job.
    Split at the job's ``dispatched_at`` (when it picked the worker; the same host's
    clock): from the request's ``created_at`` to it (the client's send, one hop, the
    job's intake and admission), and from it to the forward's arrival (the forward's
    send, the second hop).
    """
    topics = Topics(settings.topic_prefix)
    samples: list[float] = []
    to_dispatch: list[float] = []
    from_dispatch: list[float] = []
    for i in range(num_probes):
        tenant_id = tenant(i % 10)
        request = InferenceRequest(
            request_id=f"req_latency{i:06d}",
            session_id="sess_latency",
            tenant_id=tenant_id,
            model=settings.served_model_name,
            prompt=prompt(0, i),
            reply_to=reply_topic(settings),
            created_at=datetime.now(UTC),
        )
        value, headers = encode(request), credentials.headers(tenant_id)
        arrival = asyncio.ensure_future(counter.next_arrival(timeout_s=10))
        await asyncio.sleep(0)  # the waiter is armed before the request leaves
        started, sent_at = time.perf_counter(), time.time()
        await producer.send_and_wait(
            topics.requests(1), value, key=tenant_id.encode(), headers=headers
        )
        took = await arrival - started
        samples.append(took)
        if counter.last_dispatched_at is not None:
            to_dispatch.append(counter.last_dispatched_at - sent_at)
            from_dispatch.append(sent_at + took - counter.last_dispatched_at)
        await asyncio.sleep(0.02)
    legs = {"to_dispatch": to_dispatch, "dispatch_to_arrival": from_dispatch}
    return summarize(samples, 1000), {
        name: summarize(values, 1000) for name, values in legs.items() if values
    }


async def _probe(
    settings: Any,
    producer: Any,
    counter: ForwardCounter,
    credentials: Credentials,
    timeout_s: float = 60,
) -> None:
    """Waits until the job has seen a heartbeat and forwards: a probe request arrives.

    Each probe has an id of its own: the job runs a (tenant, request id) once, so a
    probe it refused (no worker yet) would only be answered as a duplicate."""
    topics = Topics(settings.topic_prefix)
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while counter.num_forwarded == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the job forwarded nothing to the pretend workers")
        probe = InferenceRequest(
            request_id=f"req_probe{attempt:04d}",
            tenant_id="bench-probe",
            model=settings.served_model_name,
            prompt="probe",
            reply_to=reply_topic(settings),
        )
        attempt += 1
        await producer.send_and_wait(
            topics.requests(1),
            encode(probe),
            key=b"bench-probe",
            headers=credentials.headers("bench-probe"),
        )
        await counter.wait_for(1, timeout_s=1.0)


def render(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    table = Table(title=title)
    for column in (
        "idle latency p50/p99 ms",
        "to dispatch / after, p50 ms",
        "tenants",
        "workers",
        "prompt tok",
        "counted by",
        "req B",
        "req/s",
        "req/s/core",
        "goal",
        "broker ms/1k",
        "job main thread",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        latency = row["idle_latency_ms"]
        table.add_row(
            f"{latency.get('p50', 0):.1f} / {latency.get('p99', 0):.1f}",
            " / ".join(
                f"{row.get('idle_legs_ms', {}).get(leg, {}).get('p50', 0):.1f}"
                for leg in ("to_dispatch", "dispatch_to_arrival")
            ),
            str(row["num_tenants"]),
            str(row["num_workers"]),
            str(row["prompt_tokens"]),
            str(row.get("counted_by", "job")),
            str(row["request_bytes"]),
            f"{row['requests_per_s']:.0f}",
            f"{row['requests_per_core_s']:.0f}",
            "met" if row["requests_per_core_s"] >= GOAL_PER_CORE else "NOT met",
            f"{row['broker_cpu_ms_per_1k']:.0f}",
            _main_thread_share(row.get("job_cpu_s_by_thread")),
        )
    console.print(table)


def _main_thread_share(by_thread: dict[str, float] | None) -> str:
    """The job's main thread's share of its CPU (rows written before it was measured:
    ``-``)."""
    if not by_thread:
        return "-"
    total = by_thread["main"] + by_thread["other_threads"]
    return f"{100 * by_thread['main'] / total:.0f}%" if total > 0 else "-"


def print_profile(profile: dict[str, Any] | None, console: Console, title: str) -> None:
    if not profile:
        return
    table = Table(title=f"{title}: py-spy, {profile['num_samples']} samples")
    table.add_column("self %", justify="right")
    table.add_column("self frame")
    table.add_column("incl %", justify="right")
    table.add_column("inclusive frame")
    for own, incl in zip(profile["self"], profile["inclusive"], strict=False):
        table.add_row(str(own["pct"]), own["frame"], str(incl["pct"]), incl["frame"])
    console.print(table)
    if profile.get("by_package"):
        shares = ", ".join(f"{row['package']} {row['pct']}%" for row in profile["by_package"])
        console.print(f"self time by package: {shares}")


async def _main(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    with progress(console) as bar:
        task = bar.add_task("admission", total=args.requests)
        row = await run_admission(
            num_requests=args.requests,
            num_tenants=args.tenants,
            num_workers=args.workers,
            prompt_tokens=args.prompt_tokens,
            overrides=parse_overrides(args.set),
            profile_to=RESULTS_DIR / "admission.pyspy.txt" if args.profile else None,
            on_progress=lambda n: bar.update(task, completed=n),
            counted_by=args.counted_by,
            pin_job=args.pin_job,
        )
    return {
        "load_start": load_start,
        "load_end": uptime_load(),
        "goal_per_core": GOAL_PER_CORE,
        "results": [row],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument(
        "--counted-by",
        choices=("bridge", "job"),
        default="bridge",
        help="who counts the prompts: the bridge (its count vouched for on each record, as "
        "the bridge sends it) or the job (a program's client's records)",
    )
    add_pin_job_arg(parser)
    parser.add_argument("--profile", action="store_true", help="py-spy the job (slows it)")
    parser.add_argument("--name", help="result file name (default: from the options)")
    add_settings_args(parser)
    run_benchmark(parser, None, _main, _show, profiled_name("admission"))


def _show(result: dict[str, Any], console: Console) -> None:
    render(result["results"], console, "admission through the Faust job")
    print_profile(result["results"][0]["profile"], console, "Faust job")


if __name__ == "__main__":
    main()
