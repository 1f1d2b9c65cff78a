"""The chaos matrix on the real stack (``make chaos``): four faults, each under steady
load from 20 tenants, and a table of what each cost.

    python -m tests.load.chaos [--rows quota_abuse,instance_loss,network_delay,job_loss]
                               [--quota-abuse-s 300] [--delay-s 60]

- **quota abuse**: one more tenant, whose TPM is what it sends in steady state (the
  baseline carries it), sends at 300% of its TPM for ``--quota-abuse-s`` (5 minutes by
  default). Its admitted tokens stay within 1% of its limit in every minute, and the
  other tenants' TTFT p99 moves by less than 20% against the same load without the
  abuse (the baseline before it and as long after it, pooled): the excess is refused,
  cheaply.
- **instance loss**: SIGKILL a third of the workers (one of three), restart it.
- **network delay**: one worker runs in a network namespace of its own, and reaches the
  broker only through a proxy that adds 500 ms to every byte each way for ``--delay-s``
  (tests/load/delay_proxy.py; this kernel has no ``netem``). Streams slow down; none is
  lost or duplicated; no worker is declared lost.
- **job loss**: SIGKILL the Faust job mid-window, restart it.

Every row reports its recovery time (from the repair, the restart or the delay's
removal, to the first 10 s in which the clients received at least 90% of the tokens a
second they received before the fault), lost requests, requests run twice, and billing
against delivered tokens. Needs root (``ip netns``, ``setns``).

The namespace is joined to the host by a veth pair on a private /30 that exists only on
this machine. The bundled broker listens and advertises on the host's end of it. Inside
the namespace that address is local too, and the proxy listens there: so every
connection the namespaced worker makes to the broker, bootstrap or advertised, goes
through the proxy, which connects on from the host's side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from producers import TokenbusClient
from schemas import InferenceRequest, SamplingParams, TokenChunk, WorkItem, decode
from tests.integration.test_quotas import as_time, job_metrics
from tests.load.cpu import CpuSampler, cores
from tests.load.delay_proxy import DelayProxy, listen_in
from tests.load.steady import Audit, SteadyLoad, audit, worker_gauge, worker_gauges
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.topics import Topics
from tokenbus_cli.stack import REPO_ROOT, Stack, free_port, settings_env

NUM_TENANTS = 20
WARM_UP_S = 10.0
BASELINE_S = 30.0
RECOVERY_LIMIT_S = 90.0

ABUSER = "chaos-abuser"
ABUSER_TPM = 2400
"""With 24-token requests, 1% of it is one request: the accuracy check can see one."""
ABUSE_REQUEST = SamplingParams(max_tokens=22, ignore_eos=True)  # prompt "x": 24 tokens
ABUSER_STEADY_RATE = ABUSER_TPM / 24 / 60
"""Requests a second that spend the TPM exactly: the abuser's steady state."""
ABUSE_BASELINE_S = 120.0
"""The others' TTFT before the abuse, and again after it, at the least: a p99 wants
several hundred samples, and a minute's p99 on these shared cores moved by 3x with no
abuse at all (run E). A longer abuse gets half its length before and half after, so the
baseline holds as many samples as the abuse."""
ABUSER_NICE = 10

NETNS = "tokenbus-chaos"
VETH_HOST, VETH_NS = "tbchaos0", "tbchaos1"
# A /30 that exists only on this machine: the host's end and the namespace's end.
HOST_ADDR, NS_ADDR = "10.231.77.1", "10.231.77.2"
DELAY_S = 0.5

KILLED_WORKER = "worker-1"
DELAYED_WORKER = "worker-2"


@dataclass
class Row:
    name: str
    recovery_s: float | None
    audit: Audit
    notes: str
    passed: bool
    unanswered: list[InferenceRequest]
    """Requests whose clients heard nothing for ``client_timeout_s``."""


Fault = Callable[[Stack, SteadyLoad, float], Awaitable[tuple[float, str, bool]]]
"""Runs one fault under the load, given the tokens a second before it. Returns when the
repair happened (monotonic), what to note, and whether the row's own criteria held."""


async def under_steady_load(
    stack: Stack,
    name: str,
    fault: Fault,
    *,
    baseline_s: float = BASELINE_S,
    extra_outcomes: Mapping[str, Sequence[TokenChunk]] | None = None,
    extra_tenants: tuple[str, ...] = (),
    before_load: Callable[[Stack], Awaitable[None]] | None = None,
) -> Row:
    """20 tenants' steady load (after ``before_load``, if given); a warm-up; the tokens a
    second over ``baseline_s``; the fault; the time until the clients are served as
    before; then the audit."""
    tenants = [f"{name}-{n:02d}" for n in range(NUM_TENANTS)]
    async with TokenbusClient(stack.settings) as client:
        if before_load is not None:
            await before_load(stack)
        load = SteadyLoad(client, tenants, baseline_s=baseline_s)
        load.start()
        try:
            await asyncio.sleep(WARM_UP_S)
            start = time.monotonic()
            await asyncio.sleep(baseline_s)
            baseline = load.rate(start, time.monotonic())
            repaired_at, notes, passed = await fault(stack, load, baseline)
            recovery = await load.recovery_s(baseline, repaired_at, RECOVERY_LIMIT_S)
        except BaseException:
            load.abandon()
            raise
        await load.stop()
        print(
            f"{name}: tokens/s per 10 s from the baseline's start ({baseline:.0f} before the "
            f"fault, repaired at {repaired_at - start:+.0f}s): {load.series(start)}",
            flush=True,
        )
    outcomes: dict[str, Sequence[Chunk | TokenChunk]] = {**load.outcomes, **(extra_outcomes or {})}
    result = await audit(
        stack.settings,
        outcomes,
        [*tenants, *extra_tenants],
        num_unanswered=len(load.unanswered),
    )
    passed = passed and result.num_lost == 0 and result.num_run_twice == 0
    passed = passed and result.billing_exact and recovery is not None
    row = Row(name, recovery, result, notes, passed, load.unanswered)
    print(f"{name}: {result.line()}; recovery {recovery} s; {notes}", flush=True)
    return row


# -- the faults -----------------------------------------------------------------------------
async def _until_mid_stream(stack: Stack, load: SteadyLoad, worker: str | None = None) -> None:
    """Until at least 5 streams are mid-way and, if ``worker`` is named, two or more of
    the requests the job forwarded to it are streaming with at most half their tokens
    received, so the fault cuts streams there mid-way. (The job's heartbeat gauges say
    only that the worker was generating half a second ago: a 48-token stream can end
    between such a heartbeat and the kill.)"""
    settings = stack.settings
    forwarded: set[str] = set()
    watching = None
    if worker is not None:
        watching = asyncio.create_task(_watch_forwards(settings, worker, forwarded))

    def cut_there() -> int:
        return load.mid_stream(forwarded, at_most_tokens=load.max_tokens // 2)

    try:
        deadline = time.monotonic() + 60
        while not (load.mid_stream() >= 5 and (worker is None or cut_there() >= 2)):
            assert time.monotonic() < deadline, (
                f"{load.mid_stream()} mid-way, {cut_there()} of them early on {worker} "
                f"({len(forwarded)} forwarded there):\n{worker_gauges(settings)}"
            )
            if watching is not None and watching.done():
                watching.result()  # the watch failed: say why
            await asyncio.sleep(0.05)
    finally:
        if watching is not None:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)


async def _watch_forwards(settings: Settings, worker: str, forwarded: set[str]) -> None:
    """Adds the id of every request the job forwards to ``worker`` from now on: a
    consumer of the worker's topic of its own, in no group, from the topic's end."""
    consumer = make_consumer(
        settings,
        Topics(settings.topic_prefix).worker(worker),
        group_id=None,
        auto_offset_reset="latest",
    )
    await consumer.start()
    try:
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    forwarded.add(decode(WorkItem, record.value).request_id)
    finally:
        await consumer.stop()


def instance_loss(worker: str) -> Fault:
    """SIGKILL one worker of three mid-stream, start it again after 5 s."""

    async def fault(stack: Stack, load: SteadyLoad, baseline: float) -> tuple[float, str, bool]:
        await _until_mid_stream(stack, load, worker)
        killed_at = time.monotonic()
        await stack.kill(worker)
        await asyncio.sleep(5)
        await stack.revive(worker, timeout_s=600)
        revived_at = time.monotonic()
        return revived_at, f"{worker} down {revived_at - killed_at:.0f} s", True

    return fault


async def job_loss(stack: Stack, load: SteadyLoad, baseline: float) -> tuple[float, str, bool]:
    """SIGKILL the Faust job mid-window (requests waiting and streaming), start it again."""
    await _until_mid_stream(stack, load)
    killed_at = time.monotonic()
    await stack.kill("stream_job")
    await asyncio.sleep(5)
    await stack.revive("stream_job", timeout_s=180)
    revived_at = time.monotonic()
    return revived_at, f"stream_job down {revived_at - killed_at:.0f} s", True


def network_delay(proxy: DelayProxy, delay_s: float) -> Fault:
    """500 ms each way between the namespaced worker and the broker for ``delay_s``. The
    job's counters say whether a worker was declared lost, or a request sent elsewhere."""

    async def fault(stack: Stack, load: SteadyLoad, baseline: float) -> tuple[float, str, bool]:
        settings = stack.settings
        counters = ("num_workers_lost", "num_redispatched", "num_resumed")
        before = job_metrics(settings)
        began = time.monotonic()
        proxy.delay_s = DELAY_S
        try:
            await asyncio.sleep(delay_s)
            during = load.rate(began + 10, time.monotonic())
            running = worker_gauge(settings, "num_running", DELAYED_WORKER)
        finally:
            proxy.delay_s = 0.0
        removed_at = time.monotonic()
        await asyncio.sleep(30)  # a worker presumed dead late would show now
        after = job_metrics(settings)
        moved = {
            c: after[f"tokenbus_job_{c}_total"] - before[f"tokenbus_job_{c}_total"]
            for c in counters
        }
        notes = (
            f"{1000 * DELAY_S:.0f} ms each way for {delay_s:.0f} s on {DELAYED_WORKER} "
            f"({proxy.num_connections} connections through the proxy): {during:.0f} "
            f"tokens/s during (before {baseline:.0f}), {DELAYED_WORKER} running "
            f"{running:.0f}; job counters moved {moved}"
        )
        return removed_at, notes, not any(moved.values())

    return fault


@dataclass
class QuotaAbuse:
    """One more tenant, whose TPM is what it uses in steady state: it sends its quota's
    worth (100% of its TPM) from before the load starts, so the baseline carries it,
    then 300% of it for ``abuse_s``. The quota should refuse the excess, and refusing
    it should cost the others nothing that matters.

    It runs as a process of its own (tests/load/abuser.py). Reports its admitted tokens
    in every whole minute of the abuse and in the minute before, the others' TTFT before
    and during, and the cores each service used before and during."""

    abuse_s: float
    outcomes: dict[str, list[TokenChunk]] = field(default_factory=dict)
    _process: asyncio.subprocess.Process | None = None
    _out: Path | None = None
    _cpu: CpuSampler | None = None

    async def start(self, stack: Stack) -> None:
        """Before the others' load: the abuser at its steady rate."""
        self._out = stack.settings.home / f"abuser-{int(time.time())}.jsonl"
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.load.abuser",
            ABUSER,
            str(ABUSER_STEADY_RATE),
            str(ABUSE_REQUEST.max_tokens),
            str(self._out),
            env=settings_env(stack.settings),
            cwd=REPO_ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            # On a fleet the abusing program runs on hosts of its own; here it shares two
            # cores with the measured clients, so its own CPU yields to theirs. What it
            # costs the stack (the broker, the job, the engine) is not niced.
            preexec_fn=lambda: os.nice(ABUSER_NICE),
        )
        assert self._process.stdout is not None
        line = await asyncio.wait_for(self._process.stdout.readline(), timeout=60)
        assert line.strip() == b"sending", f"the abuser said {line!r}"
        roots = {s.name: s.process.pid for s in stack.services}
        self._cpu = CpuSampler({**roots, "clients": os.getpid(), ABUSER: self._process.pid})
        self._cpu.start()

    def close(self) -> None:
        """Whatever happened: the abuser and the sampler stop."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
        if self._cpu is not None:
            self._cpu.cancel()

    async def fault(
        self, stack: Stack, load: SteadyLoad, baseline: float
    ) -> tuple[float, str, bool]:
        assert self._process is not None and self._process.stdin is not None
        assert self._out is not None and self._cpu is not None
        load_before = os.getloadavg()[0]
        self._process.stdin.write(f"{3 * ABUSER_STEADY_RATE}\n".encode())
        await self._process.stdin.drain()
        await asyncio.sleep(self.abuse_s)
        self._process.stdin.close()
        assert await self._process.wait() == 0, f"the abuser failed ({self._process.returncode})"
        await self._cpu.stop()
        load_after = os.getloadavg()[0]
        lines = self._out.read_bytes().splitlines()
        times = orjson.loads(lines[0])
        for line in lines[1:]:
            request = orjson.loads(line)
            self.outcomes[request["request_id"]] = [
                TokenChunk.model_validate(c) for c in request["chunks"]
            ]
        # The abuse's own span, on this process's clock and on the wall's.
        (steady_from_wall, _), (abuse_from_wall, _) = times["phases"]
        to_monotonic = time.monotonic() - time.time()
        sent_from, ended = abuse_from_wall + to_monotonic, times["ended"] + to_monotonic
        # The others' TTFT without the abuse: the baseline before it and as long after it
        # (the abuser back at its steady rate), pooled. A p99 of a few hundred samples
        # is a handful of the slowest; and this machine drifts over a run (the load
        # average rose by a third in run L). Before and after, the baseline brackets
        # the abuse in time, and holds as many samples as the abuse's own window.
        before = (sent_from - load.baseline_s, sent_from)
        after = (ended, ended + load.baseline_s)
        await asyncio.sleep(max(0.0, after[1] - time.monotonic()))
        p50_before, p99_before = load.ttft_quantiles(*before)
        p50_after, p99_after = load.ttft_quantiles(*after)
        p50_without, p99_without = load.ttft_quantiles_over([before, after])
        p50_during, p99_during = load.ttft_quantiles(sent_from, ended)
        change = p99_during / p99_without - 1
        change_before = p99_during / p99_before - 1
        # How much p99 moves with no abuse at all: the baseline's two halves.
        half = before[0] + load.baseline_s / 2
        p99_halves = (
            load.ttft_quantiles(before[0], half)[1],
            load.ttft_quantiles(half, sent_from)[1],
        )
        p99_minutes = [
            load.ttft_quantiles(t, min(t + 60, ended))[1] for t in _steps(sent_from, ended, 60)
        ]
        (stack.settings.home / f"ttft-{int(time.time())}.json").write_bytes(
            orjson.dumps({"began": sent_from, "ended": ended, "samples": load.ttft})
        )
        admitted = await _admitted(stack.settings, times["ended"])
        minutes = admitted_per_minute(admitted, abuse_from_wall, times["ended"])
        (minute_before,) = admitted_per_minute(admitted, abuse_from_wall - 60, abuse_from_wall)
        within = bool(minutes) and all(0.99 * ABUSER_TPM <= t <= ABUSER_TPM for t in minutes)
        error = max((abs(t - ABUSER_TPM) / ABUSER_TPM for t in minutes), default=float("nan"))
        refused = sum(
            1
            for chunks in self.outcomes.values()
            if chunks and chunks[-1].error is not None and chunks[-1].error.code == "quota_exceeded"
        )
        cpu_before = cores(self._cpu.snapshots, *before)
        cpu_during = cores(self._cpu.snapshots, sent_from, ended)
        notes = (
            f"{ABUSER} (TPM {ABUSER_TPM}) sent {ABUSER_STEADY_RATE * 60:.0f} requests a minute "
            f"from {times['phases'][1][0] - steady_from_wall:.0f} s before the abuse, then 300% "
            f"for {self.abuse_s:.0f} s; {len(self.outcomes)} requests, {refused} refused "
            f"(quota_exceeded); admitted tokens in the minute before {minute_before}, in each "
            f"minute of the abuse {minutes} (error up to {error:.2%}); others' TTFT p50 / p99 "
            f"{1000 * p50_during:.0f} / {1000 * p99_during:.0f} ms during the abuse, "
            f"{1000 * p50_without:.0f} / {1000 * p99_without:.0f} ms without it (the "
            f"{load.baseline_s:.0f} s before and after, pooled): p99 {change:+.1%} (against "
            f"the {1000 * p50_before:.0f} / {1000 * p99_before:.0f} ms before alone "
            f"{change_before:+.1%}; after alone {1000 * p50_after:.0f} / "
            f"{1000 * p99_after:.0f} ms); p99 per minute of abuse {_ms(p99_minutes)}; the "
            f"before baseline's two halves {_ms(p99_halves)}; cores before / during: "
            f"{_cores(cpu_before, cpu_during)}; "
            f"1-minute load average {load_before:.1f} at the abuse's start, {load_after:.1f} at "
            "its end"
        )
        return ended, notes, within and abs(change) < 0.20


def _steps(since: float, until: float, step: float) -> list[float]:
    return [since + step * k for k in range(max(1, int((until - since) // step)))]


def _ms(values: Sequence[float]) -> str:
    return "/".join(f"{1000 * v:.0f}" for v in values) + " ms"


def _cores(before: dict[str, float], during: dict[str, float]) -> str:
    return ", ".join(
        f"{name} {before[name]:.2f} / {during[name]:.2f}"
        for name in sorted(before, key=lambda n: -during.get(n, 0))
        if name in during
    )


def admitted_per_minute(
    admitted: Sequence[tuple[float, int]], since: float, until: float, window_s: float = 59.9
) -> list[int]:
    """Tokens admitted (wall time, tokens) in each whole minute from ``since`` that ends
    by ``until``. The quota's window slides in 100 ms steps, so a minute is 59.9 s of
    admissions: a request a step past the edge may take a token the window has freed."""
    minutes = []
    start = since
    while start + window_s <= until:
        minutes.append(sum(n for t, n in admitted if start <= t < start + window_s))
        start += 60
    return minutes


ADMITTED_SQL = """
SELECT request_id, min(toUnixTimestamp64Micro(start_time)) AS queued_us
FROM spans FINAL
WHERE tenant_id = {tenant:String} AND name = 'job.queue'
GROUP BY request_id
"""
"""When the job admitted each of a tenant's requests: its ``job.queue`` span starts at
admission (the fair queue's wait), on the job's clock, which is the quota window's."""


async def _admitted(settings: Settings, ended: float) -> list[tuple[float, int]]:
    """The abuser's admitted requests, (admission wall time, tokens), once billing holds
    the last ones and a span for each (or a minute has passed).

    By the job's admission time, not the row's ``created_at``: that is the producer's
    clock at submit, and the window counts a request when the job admits it. Under this
    row's load (26-30 on two cores) the two differ by a varying lag, and a request
    submitted before a minute's edge but admitted after it counted in the wrong minute."""
    from billing.reader import open_reader
    from tests.integration.test_quotas import usage

    reader = open_reader(settings)
    deadline = time.monotonic() + 60
    try:
        while True:
            rows = await asyncio.to_thread(usage, settings, [ABUSER])
            ok = [r for r in rows if r["status"] == "ok"]
            spans = await asyncio.to_thread(reader.query, ADMITTED_SQL, {"tenant": ABUSER})
            queued = {span["request_id"]: span["queued_us"] / 1e6 for span in spans}
            missing = sum(1 for r in ok if r["request_id"] not in queued)
            if ok and not missing and as_time(ok[-1]["created_at"]).timestamp() > ended - 5:
                break
            if time.monotonic() > deadline:
                print(f"{missing} of the abuser's {len(ok)} requests have no job.queue span yet")
                break
            await asyncio.sleep(1)
    finally:
        reader.close()
    return [
        (queued[r["request_id"]], r["prompt_tokens"] + r["completion_tokens"])
        for r in ok
        if r["request_id"] in queued
    ]


# -- the network namespace ------------------------------------------------------------------
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def network_namespace() -> Iterator[list[str]]:
    """A namespace joined to the host by a veth pair on a private /30; yields the
    command a process runs under to live in it. Removed on the way out, whatever
    happened (deleting the namespace deletes the pair)."""
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "delete", NETNS)  # left by a run that was itself killed
    try:
        _ip("netns", "add", NETNS)
        _ip("link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
        _ip("link", "set", VETH_NS, "netns", NETNS)
        _ip("addr", "add", f"{HOST_ADDR}/30", "dev", VETH_HOST)
        _ip("link", "set", VETH_HOST, "up")
        _ip("-n", NETNS, "addr", "add", f"{NS_ADDR}/30", "dev", VETH_NS)
        _ip("-n", NETNS, "link", "set", VETH_NS, "up")
        _ip("-n", NETNS, "link", "set", "lo", "up")
        # The broker's address is local inside too: the delay proxy listens there.
        _ip("-n", NETNS, "addr", "add", f"{HOST_ADDR}/32", "dev", "lo")
        yield ["ip", "netns", "exec", NETNS]
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "delete", VETH_HOST)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "delete", NETNS)


# -- the stack and the table ----------------------------------------------------------------
async def start_stack(
    home: Path, kafka_port: int, wrapper: list[str], abuser_burst_s: float
) -> Stack:
    """The stack on the veth's host address: broker, billing, job, bridge, worker-0 and
    worker-1 on the host, worker-2 in the namespace. The abusing tenant's TPM is smoothed
    over ``abuser_burst_s`` (0: off), as an operator protecting the others would set it."""
    model_dir = Stack(Settings(home=REPO_ROOT / ".tokenbus"), on_progress=print).build_model()
    tenants_file = home / "tenants.json"
    tenants_file.write_text(
        json.dumps(
            {"tenants": {ABUSER: {"tpm": ABUSER_TPM, "rpm": 100_000, "burst_s": abuser_burst_s}}}
        )
    )
    settings = Settings(
        home=home,
        kafka_host=HOST_ADDR,
        kafka_port=kafka_port,
        billing_query_port=free_port(),
        faust_web_port=free_port(),
        bridge_port=free_port(),
        batch_port=free_port(),
        model_path=model_dir,
        tenants_file=tenants_file,
        client_timeout_s=120,
        allow_unlisted_tenants=True,
    )
    stack = Stack(settings, on_progress=print)
    await stack.start()
    # Two vLLM engines loading at once on two cores that other stacks share: 300 s was
    # not always enough.
    await asyncio.gather(
        stack.add_worker(KILLED_WORKER, max_num_seqs=16, timeout_s=600),
        stack.add_worker(DELAYED_WORKER, max_num_seqs=16, wrapper=wrapper, timeout_s=600),
    )
    return stack


ROWS = ("quota_abuse", "instance_loss", "network_delay", "job_loss")


async def chaos(
    rows: list[str], abuse_s: float, delay_s: float, home: Path, abuser_burst_s: float
) -> list[Row]:
    results: list[Row] = []
    kafka_port = free_port()
    with network_namespace() as wrapper:
        proxy = DelayProxy(listen_in(NETNS, HOST_ADDR, kafka_port), (HOST_ADDR, kafka_port))
        await proxy.start()
        try:
            stack = await start_stack(home, kafka_port, wrapper, abuser_burst_s)
        except BaseException:
            await proxy.stop()
            raise
        try:
            for name in rows:
                try:
                    results.append(await _run_row(stack, proxy, name, abuse_s, delay_s))
                except Exception as exc:  # the next row still runs; this one failed
                    print(f"{name}: failed: {exc!r}", flush=True)
                    empty = Audit(0, 0, {}, 0, 0, 0, 0, 0, 0, 0, 0, 0, [], [])
                    results.append(Row(name, None, empty, f"failed: {exc!r}", False, []))
        finally:
            stack.stop()
            await proxy.stop()
    return results


async def _run_row(
    stack: Stack, proxy: DelayProxy, name: str, abuse_s: float, delay_s: float
) -> Row:
    stack.check()
    if name == "quota_abuse":
        abuse = QuotaAbuse(abuse_s)
        try:
            row = await under_steady_load(
                stack,
                "abuse",
                abuse.fault,
                baseline_s=max(ABUSE_BASELINE_S, abuse_s / 2),
                extra_outcomes=abuse.outcomes,
                extra_tenants=(ABUSER,),
                before_load=abuse.start,
            )
        finally:
            abuse.close()
    elif name == "instance_loss":
        row = await under_steady_load(stack, "loss", instance_loss(KILLED_WORKER))
    elif name == "network_delay":
        row = await under_steady_load(stack, "delay", network_delay(proxy, delay_s))
    else:
        row = await under_steady_load(stack, "jobkill", job_loss)
    row.name = name
    return row


def table(rows: list[Row]) -> str:
    lines = [
        "| row | recovery (s) | lost | run twice | billed / delivered tokens | requests | passed"
        " | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        a = row.audit
        recovery = "not in 90 s" if row.recovery_s is None else f"{row.recovery_s:.0f}"
        billing = f"{a.tokens_billed} / {a.tokens_delivered}" + (
            "" if a.billing_exact else f" ({len(a.mismatched)} differ, {a.num_unbilled} unbilled)"
        )
        lines.append(
            f"| {row.name} | {recovery} | {a.num_lost} | {a.num_run_twice} | {billing} | "
            f"{a.num_requests} ({a.num_ok} ok, {a.errors or 'no errors'}) | "
            f"{'yes' if row.passed else 'NO'} | {row.notes} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated, in order")
    parser.add_argument("--quota-abuse-s", type=float, default=300.0)
    parser.add_argument("--delay-s", type=float, default=60.0)
    parser.add_argument(
        "--abuser-burst-s",
        type=float,
        default=0.0,
        help="the abusing tenant's burst_s (README, Smoothing); 0, the default: off",
    )
    parser.add_argument("--home", type=Path, default=None, help="default: a temporary dir")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if unknown := set(rows) - set(ROWS):
        parser.error(f"unknown rows {sorted(unknown)}; rows are {', '.join(ROWS)}")
    home = args.home or Path(tempfile.mkdtemp(prefix="tokenbus-chaos-"))
    home.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C: the stack stops, the namespace goes.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.monotonic()
    results = asyncio.run(chaos(rows, args.quota_abuse_s, args.delay_s, home, args.abuser_burst_s))
    print(f"\nchaos matrix, {time.monotonic() - started:.0f} s, home {home}:")
    print(table(results), flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
