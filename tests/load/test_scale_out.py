"""Scale-out on one machine (``make scale``): two Faust job instances in one group share
the request partitions, two bridges, three vLLM workers. Under steady load from 20
tenants, each at twice its TPM, one job instance stops mid-window (its partitions move
to the other) and starts again. Quotas hold within 1%, every request ends exactly once,
and billing equals the tokens delivered."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from datetime import timedelta

from producers import TokenbusClient
from schemas import SamplingParams, TokenChunk
from tests.integration.conftest import eventually
from tests.integration.fleet import fleet, fleet_client
from tests.integration.test_quotas import as_time, run, usage
from tokenbus.stack import Stack, http_ok

__all__ = ["fleet", "fleet_client"]

TENANTS = [f"scale-{n:02d}" for n in range(20)]
TPM = 600  # conftest.TENANTS
SHORT = SamplingParams(max_tokens=22, ignore_eos=True)  # with the prompt "x": 24 tokens
WINDOW_S = 60.0


async def test_two_job_instances_share_the_partitions_and_one_stops_mid_window(
    fleet_client: TokenbusClient, fleet: Stack
) -> None:
    settings = fleet.settings
    second_job = fleet.add_job("stream_job-1")
    second_bridge = fleet.add_bridge("bridge-1")
    try:
        await fleet.wait_ready(second_job, 120)
        await fleet.wait_ready(second_bridge, 60)
        for bridge in (fleet.service("bridge"), second_bridge):
            assert await asyncio.to_thread(http_ok, f"http://127.0.0.1:{bridge.port}/healthz")

        per_second = 2 * TPM / 24 / WINDOW_S  # requests a second per tenant, at 2x TPM
        tasks: list[asyncio.Task[list[TokenChunk]]] = []
        started = time.monotonic()
        stopped_at = revived_at = None
        revive: asyncio.Task[None] | None = None
        i = 0
        while time.monotonic() - started < WINDOW_S + 5:
            elapsed = time.monotonic() - started
            if stopped_at is None and elapsed > 20:
                stopped_at = elapsed
                await fleet.kill("stream_job-1", signal.SIGTERM)
            if revived_at is None and elapsed > 35:
                revived_at = elapsed
                revive = asyncio.create_task(fleet.revive("stream_job-1", timeout_s=120))
            for tenant in TENANTS:
                request = await fleet_client.submit(tenant_id=tenant, prompt="x", sampling=SHORT)
                tasks.append(asyncio.create_task(run(fleet_client, request)))
            i += 1
            await asyncio.sleep(max(0.0, started + i / per_second - time.monotonic()))
        results = await asyncio.gather(*tasks)
        assert revive is not None
        await revive  # the instance is back and healthy

        # Every request ended once: 22 tokens in gapless order, or a quota refusal.
        for chunks in results:
            assert [c.seq for c in chunks] == list(range(len(chunks)))
            last = chunks[-1]
            assert last.is_last
            if last.error is not None:
                assert last.error.code == "quota_exceeded", last.error
            else:
                assert sum(c.num_tokens for c in chunks) == 22

        rows = await eventually(
            lambda: usage(settings, TENANTS), until=lambda r: len(r) >= len(tasks), timeout_s=90
        )
        per_request = Counter(r["request_id"] for r in rows)
        assert max(per_request.values()) == 1, "a request was billed (run) twice"
        assert len(per_request) == len(tasks), "a request was lost"
        delivered = {chunks[0].request_id: sum(c.num_tokens for c in chunks) for chunks in results}
        billed = {r["request_id"]: r["completion_tokens"] for r in rows}
        assert billed == delivered

        errors = []
        for tenant in TENANTS:
            admitted = [r for r in rows if r["tenant_id"] == tenant and r["status"] == "ok"]
            first = as_time(admitted[0]["created_at"])
            in_window = [
                r for r in admitted if as_time(r["created_at"]) < first + timedelta(seconds=59.9)
            ]
            tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in in_window)
            if not 0.99 * TPM <= tokens <= TPM:
                errors.append((tenant, tokens))
        print(
            f"scale-out: {len(tasks)} requests, job instance stopped at {stopped_at:.0f} s and "
            f"started at {revived_at:.0f} s; tenants outside 1% of {TPM} TPM: {errors}"
        )
        assert not errors
    finally:
        for name in ("bridge-1", "stream_job-1"):
            fleet.remove(name)
