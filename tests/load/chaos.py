"""The chaos matrix on the real stack (``make chaos``): four faults, each under steady
load from 20 tenants, and a table of what each cost.

    python -m tests.load.chaos [--rows quota_abuse,instance_loss,network_delay,job_loss]
                               [--quota-abuse-s 300] [--delay-s 60]

- **quota abuse**: one more tenant sends at 300% of its TPM for ``--quota-abuse-s``
  (5 minutes by default). Its admitted tokens stay within 1% of its limit in every
  minute, and the other tenants' TTFT p99 moves by less than 20%.
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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import orjson

from producers import TokenbusClient
from schemas import InferenceRequest, SamplingParams, TokenChunk
from tests.integration.conftest import free_port
from tests.integration.test_quotas import as_time, job_metrics
from tests.load.delay_proxy import DelayProxy, listen_in
from tests.load.steady import Audit, SteadyLoad, audit, worker_gauge, worker_gauges
from tokenbus.config import Settings
from tokenbus_cli.stack import REPO_ROOT, Stack, settings_env

NUM_TENANTS = 20
WARM_UP_S = 10.0
BASELINE_S = 30.0
RECOVERY_LIMIT_S = 90.0

ABUSER = "chaos-abuser"
ABUSER_TPM = 2400
ABUSE_BASELINE_S = 60.0
ABUSER_NICE = 10
"""The others' TTFT before the abuse: a p99 wants a few hundred samples."""
ABUSE_REQUEST = SamplingParams(max_tokens=22, ignore_eos=True)  # prompt "x": 24 tokens

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
    extra_outcomes: dict[str, list[TokenChunk]] | None = None,
    extra_tenants: tuple[str, ...] = (),
) -> Row:
    """20 tenants' steady load; a warm-up; the tokens a second over ``baseline_s``; the
    fault; the time until the clients are served as before; then the audit."""
    tenants = [f"{name}-{n:02d}" for n in range(NUM_TENANTS)]
    async with TokenbusClient(stack.settings) as client:
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
    outcomes = {**load.outcomes, **(extra_outcomes or {})}
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
    """Until at least 5 streams are mid-way (and, if named, ``worker`` is generating for
    two or more requests as its last heartbeat showed), so the fault cuts streams."""
    settings = stack.settings

    def generating() -> bool:
        if worker is None:
            return True
        return (
            worker_gauge(settings, "num_running", worker) >= 2
            and worker_gauge(settings, "tokens_per_s", worker) > 0
        )

    deadline = time.monotonic() + 60
    while not (load.mid_stream() >= 5 and await asyncio.to_thread(generating)):
        assert time.monotonic() < deadline, worker_gauges(settings)
        await asyncio.sleep(0.1)


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


def quota_abuse(abuse_s: float, outcomes: dict[str, list[TokenChunk]]) -> Fault:
    """One more tenant at 300% of its TPM for ``abuse_s``, from a process of its own
    (tests/load/abuser.py); its admitted tokens in every whole minute of it, and the
    others' TTFT before and during."""

    async def fault(stack: Stack, load: SteadyLoad, baseline: float) -> tuple[float, str, bool]:
        per_second = 3 * ABUSER_TPM / 24 / 60
        out = stack.settings.home / f"abuser-{int(time.time())}.jsonl"
        began = time.monotonic()
        abuser = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.load.abuser",
            ABUSER,
            str(abuse_s),
            str(per_second),
            str(ABUSE_REQUEST.max_tokens),
            str(out),
            env=settings_env(stack.settings),
            cwd=REPO_ROOT,
            # On a fleet the abusing program runs on hosts of its own; here it shares two
            # cores with the measured clients, so its own CPU yields to theirs. What it
            # costs the stack (the broker, the job, the engine) is not niced.
            preexec_fn=lambda: os.nice(ABUSER_NICE),
        )
        assert await abuser.wait() == 0, f"the abuser failed ({abuser.returncode})"
        lines = out.read_bytes().splitlines()
        times = orjson.loads(lines[0])
        for line in lines[1:]:
            request = orjson.loads(line)
            outcomes[request["request_id"]] = [
                TokenChunk.model_validate(c) for c in request["chunks"]
            ]
        # The abuse's own span, on this process's clock.
        ended = time.monotonic() - (time.time() - times["ended"])
        sent_from = time.monotonic() - (time.time() - times["began"])
        before = (began - load.baseline_s, began)
        p50_before, p99_before = load.ttft_quantiles(*before)
        p50_during, p99_during = load.ttft_quantiles(sent_from, ended)
        change = p99_during / p99_before - 1
        # How much p99 moves with no abuse at all: the baseline's two halves.
        half = before[0] + load.baseline_s / 2
        p99_halves = (load.ttft_quantiles(before[0], half)[1], load.ttft_quantiles(half, began)[1])
        p99_minutes = [
            load.ttft_quantiles(t, min(t + 60, ended))[1] for t in _steps(sent_from, ended, 60)
        ]
        (stack.settings.home / f"ttft-{int(time.time())}.json").write_bytes(
            orjson.dumps({"began": sent_from, "ended": ended, "samples": load.ttft})
        )
        minutes = await _admitted_per_minute(stack.settings, times["began"], times["ended"])
        within = bool(minutes) and all(0.99 * ABUSER_TPM <= t <= ABUSER_TPM for t in minutes)
        error = max((abs(t - ABUSER_TPM) / ABUSER_TPM for t in minutes), default=float("nan"))
        notes = (
            f"{len(outcomes)} requests at 300% of {ABUSER_TPM} TPM for {abuse_s:.0f} s; admitted "
            f"tokens per minute {minutes} (error up to {error:.2%}); others' TTFT p50 / p99 "
            f"{1000 * p50_before:.0f} / {1000 * p99_before:.0f} ms in the {load.baseline_s:.0f} s "
            f"before, {1000 * p50_during:.0f} / {1000 * p99_during:.0f} ms during (p99 "
            f"{change:+.1%}; p99 per minute of abuse {_ms(p99_minutes)}; with no abuse, "
            f"the baseline's two halves {_ms(p99_halves)})"
        )
        return ended, notes, within and abs(change) < 0.20

    return fault


def _steps(since: float, until: float, step: float) -> list[float]:
    return [since + step * k for k in range(max(1, int((until - since) // step)))]


def _ms(values: Sequence[float]) -> str:
    return "/".join(f"{1000 * v:.0f}" for v in values) + " ms"


async def _admitted_per_minute(settings: Settings, began: float, ended: float) -> list[int]:
    """The abuser's admitted tokens in each whole minute from its first admission: the
    window slides in 100 ms steps, so a minute is 59.9 s of admissions."""
    from tests.integration.test_quotas import usage

    deadline = time.monotonic() + 60
    while True:
        rows = await asyncio.to_thread(usage, settings, [ABUSER])
        admitted = [r for r in rows if r["status"] == "ok"]
        if admitted and as_time(admitted[-1]["created_at"]).timestamp() > ended - 5:
            break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    if not admitted:
        return []
    first = as_time(admitted[0]["created_at"])
    minutes = []
    start: datetime = first
    while (start + timedelta(seconds=59.9)).timestamp() <= ended:
        minutes.append(
            sum(
                r["prompt_tokens"] + r["completion_tokens"]
                for r in admitted
                if start <= as_time(r["created_at"]) < start + timedelta(seconds=59.9)
            )
        )
        start += timedelta(seconds=60)
    return minutes


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
    await asyncio.gather(
        stack.add_worker(KILLED_WORKER, max_num_seqs=16),
        stack.add_worker(DELAYED_WORKER, max_num_seqs=16, wrapper=wrapper),
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
                    empty = Audit(0, 0, {}, 0, 0, 0, 0, 0, 0, 0, 0, [], [])
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
        abuser: dict[str, list[TokenChunk]] = {}
        row = await under_steady_load(
            stack,
            "abuse",
            quota_abuse(abuse_s, abuser),
            baseline_s=ABUSE_BASELINE_S,
            extra_outcomes=abuser,
            extra_tenants=(ABUSER,),
        )
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
