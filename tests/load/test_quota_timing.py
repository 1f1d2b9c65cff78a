"""Latency acceptance checks of the job: class 0 queueing under saturation, and overload
tier engagement and release. They measure milliseconds, so they need a quiet machine:
``make timing`` runs them on the real stack; CI does not (other suites share its cores).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from billing.reader import open_reader
from producers import TokenbusClient
from schemas import SamplingParams
from stream_jobs.tiers import Tier, TierPolicy
from tests.integration.conftest import eventually
from tests.integration.test_quotas import as_time, job_metrics, run, usage
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus_cli.stack import renice_session, settings_env


async def test_vip_queueing_stays_low_while_batch_saturates(
    client: TokenbusClient, settings: Settings
) -> None:
    # Class 2 arrives faster than the worker serves it and keeps the fleet saturated
    # (the overload tier sheds what is beyond 150% of capacity). That tenant's program
    # would run on a machine of its own: here it reads no replies, and it is niced
    # like the workers (in a session of its own: tokenbus_cli.stack.renice_session).
    flood = await asyncio.create_subprocess_exec(
        *["nice", "-n", "10", sys.executable, "-m", "tests.load.flood", "batch", "0.01", "200"],
        env=settings_env(settings),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    renice_session(flood.pid, 10)

    def saturated(metrics: dict[str, float]) -> bool:
        # Class 2 has taken every seat it may: all but those held back for class 0.
        capacity = metrics["tokenbus_job_capacity"]
        seats = capacity - math.ceil(capacity * settings.vip_reserve)
        return capacity > 0 and metrics["tokenbus_job_num_in_flight"] >= seats

    try:
        await eventually(lambda: job_metrics(settings), until=saturated)
        vip_runs, saturated_samples = await vip_while_saturated(client, settings, saturated)
    finally:
        flood.terminate()
        out, _ = await asyncio.wait_for(flood.communicate(), timeout=120)
        # The flood's admitted requests run to their end: the next test starts quiet.
        await eventually(
            lambda: job_metrics(settings),
            until=lambda m: m["tokenbus_job_num_in_flight"] == 0 and m["tokenbus_job_tier"] == 0,
            timeout_s=120,
        )
    assert flood.returncode == 0, out.decode()
    vip_results = await asyncio.gather(*vip_runs)

    assert all(chunks[-1].error is None for chunks in vip_results)
    assert sum(saturated_samples) >= 30, f"class 2 saturated {sum(saturated_samples)} of 40"
    rows = await eventually(lambda: usage(settings, ["vip"]), until=lambda r: len(r) == 40)
    queue_ms = sorted(r["queue_ms"] for r in rows)
    p99 = queue_ms[int(0.99 * (len(queue_ms) - 1))]
    # Two figures: the time class 0 waits in the job's queue (what priority and the
    # seats held back for class 0 control), and the whole way from the client's
    # submit to dispatch, which adds the Kafka intake hop (a transport cost, issue 7).
    metrics = job_metrics(settings)
    in_queue = metrics['tokenbus_job_queue_ms{priority="0",quantile="0.99"}']
    print(f"class 0 p99: {in_queue:.1f} ms queued in the job, {p99:.1f} ms submit to dispatch")
    timings = open_reader(settings).query(
        "SELECT queue_ms, ttft_ms, total_ms FROM usage_events FINAL WHERE tenant_id = 'vip'"
    )
    to_first = sorted(r["ttft_ms"] - r["queue_ms"] for r in timings)
    to_end = sorted(r["total_ms"] - r["queue_ms"] for r in timings)
    print(
        f"class 0 from dispatch: first token p50 {to_first[len(to_first) // 2]:.0f} ms, "
        f"end p50 {to_end[len(to_end) // 2]:.0f} ms, max {to_end[-1]:.0f} ms; {lags(metrics)}"
    )
    assert in_queue < 100, f"class 0 queueing p99 {in_queue:.1f} ms in the job"
    assert p99 < 500, f"class 0 submit-to-dispatch p99 {p99:.1f} ms; all: {queue_ms}"


async def test_overload_tiers_engage_and_release_within_200_ms(
    client: TokenbusClient, settings: Settings
) -> None:
    assert job_metrics(settings)["tokenbus_job_tier"] == 0
    capacity = int(job_metrics(settings)["tokenbus_job_capacity"])
    long = SamplingParams(max_tokens=600, ignore_eos=True)

    async def submit(tenant: str, priority: int) -> tuple[float, asyncio.Task[list[Chunk]]]:
        request = await client.submit(
            tenant_id=tenant, prompt="load", priority=priority, sampling=long
        )
        return time.time(), asyncio.create_task(run(client, request))

    # Each load change is a burst produced at once. This process also reads every
    # stream it starts; submitting one by one behind that work, the first requests
    # finished before the last were sent, and demand never reached 120%.
    async def burst(tenant: str, priority: int, n: int) -> list[tuple[float, Any]]:
        return sorted(await asyncio.gather(*(submit(tenant, priority) for _ in range(n))))

    # Tier 1 engages with the request that takes demand above 120% of capacity: the
    # cap_at-th to reach the broker. The job may read it a moment before its producer
    # sees the broker's ack, hence the small negative bound.
    cap_at = int(1.2 * capacity) + 1
    sent = await burst("tier-std", 1, cap_at + 5)
    metrics = await eventually(
        lambda: job_metrics(settings), until=lambda m: m["tokenbus_job_tier"] == 1
    )
    engage_cap_ms = (metrics["tokenbus_job_tier_changed_at"] - sent[cap_at - 1][0]) * 1000

    # Tier 2 engages above 150%; from then on class 2 is shed.
    shed_at = int(1.5 * capacity) + 1
    sent += await burst("tier-batch", 2, shed_at - len(sent) + 10)
    metrics = await eventually(
        lambda: job_metrics(settings), until=lambda m: m["tokenbus_job_tier"] == 2
    )
    engage_shed_ms = (metrics["tokenbus_job_tier_changed_at"] - sent[shed_at - 1][0]) * 1000

    # Release: watch the tier while the load drains.
    releases: list[tuple[int, float]] = []

    async def watch() -> None:
        while True:
            m = await asyncio.to_thread(job_metrics, settings)
            if not releases or releases[-1][0] != m["tokenbus_job_tier"]:
                releases.append((int(m["tokenbus_job_tier"]), m["tokenbus_job_tier_changed_at"]))
            if m["tokenbus_job_tier"] == 0:
                return
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(task for _, task in sent))
    await asyncio.wait_for(watcher, timeout=30)

    rows = await eventually(
        lambda: usage(settings, ["tier-std", "tier-batch"]), until=lambda r: len(r) == len(sent)
    )
    # Release: as requests finish, demand falls; each tier lets go when the job sees
    # the UsageEvent that takes demand below its release point.
    policy = TierPolicy(
        cap_above=settings.tier_cap_above,
        shed_above=settings.tier_shed_above,
        capped_max_tokens=settings.tier_capped_max_tokens,
    )
    finishes = sorted(as_time(r["finished_at"]).timestamp() for r in rows if r["status"] == "ok")
    release_ms: dict[int, float] = {}
    for (before, _), (tier, changed_at) in itertools.pairwise(releases):
        crossing = next(
            t
            for k, t in enumerate(finishes, 1)
            if policy.next_tier(Tier(before), (len(finishes) - k) / capacity) <= tier
        )
        release_ms[tier] = (changed_at - crossing) * 1000

    print(lags(job_metrics(settings)))
    print(
        f"tier engagement: cap {engage_cap_ms:.1f} ms, shed {engage_shed_ms:.1f} ms; "
        f"release: to cap {release_ms.get(Tier.CAP, float('nan')):.1f} ms, "
        f"to normal {release_ms.get(Tier.NORMAL, float('nan')):.1f} ms"
    )
    assert -20 <= engage_cap_ms < 200, engage_cap_ms
    assert -20 <= engage_shed_ms < 200, engage_shed_ms
    assert releases[0][0] == Tier.SHED and releases[-1][0] == Tier.NORMAL, releases
    assert all(0 <= ms < 200 for ms in release_ms.values()), release_ms
    shed = [c[-1].error for c in results if c[-1].error is not None]
    assert shed and all(e.code == "overloaded" and e.retry_after_s for e in shed)

    capped = [r for r in rows if "max_tokens_capped" in r["flags"]]
    assert capped, "no request was capped"
    assert all(r["completion_tokens"] == 256 and r["overload_tier"] >= 1 for r in capped)
    assert any(r["status"] == "rejected" and r["overload_tier"] == 2 for r in rows)
    # The first cap_at - 1 arrivals ran in full; the cap_at-th engaged tier 1.
    uncapped = [r for r in rows if r["tenant_id"] == "tier-std" and r["overload_tier"] == 0]
    assert len(uncapped) == cap_at - 1, len(uncapped)
    assert all(r["completion_tokens"] == 600 for r in uncapped)


async def vip_while_saturated(
    client: TokenbusClient, settings: Settings, saturated: Callable[[dict[str, float]], bool]
) -> tuple[list[asyncio.Task[list[Chunk]]], list[bool]]:
    """Class 0 requests every 50 ms, each noting whether class 2 held its seats then."""
    vip_runs = []
    saturated_samples = []
    for _ in range(40):
        request = await client.submit(
            tenant_id="vip",
            prompt="urgent",
            priority=0,
            sampling=SamplingParams(max_tokens=4, ignore_eos=True),
        )
        vip_runs.append(asyncio.create_task(run(client, request)))
        metrics = await asyncio.to_thread(job_metrics, settings)
        saturated_samples.append(saturated(metrics))
        await asyncio.sleep(0.05)
    return vip_runs, saturated_samples


def lags(metrics: dict[str, float]) -> str:
    """The job's intake lag per input, p50/p99 ms: how stale its view was."""
    lag = "tokenbus_job_intake_lag_ms"
    by_stream: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        if name.startswith(lag + "{"):
            pairs = (label.split("=") for label in name[len(lag) + 1 : -1].split(","))
            labels = {key: text.strip('"') for key, text in pairs}
            by_stream.setdefault(labels["stream"], {})[labels["quantile"]] = value
    return "intake lag p50/p99 ms: " + ", ".join(
        f"{stream} {q['0.5']:.0f}/{q['0.99']:.0f}" for stream, q in sorted(by_stream.items())
    )
