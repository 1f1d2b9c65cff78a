"""Scale-out on one machine (``make scale``): two Faust job instances in one group share
the request partitions, two bridges, three vLLM workers. Under steady load from 20
tenants, each at twice its TPM, one job instance stops mid-window (its partitions move
to the other) and starts again. Quotas hold within 1%, every request ends exactly once,
and billing equals the tokens delivered. Meanwhile one more tenant's requests go through
each bridge in turn, and each is answered and billed once, as delivered.

The 20 tenants produce to Kafka themselves (the producer client), so that the test
counts each stream's tokens as they arrive; the bridges carry the one tenant's."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import httpx

from producers import TokenbusClient
from schemas import SamplingParams
from tests.integration.conftest import bus_key, eventually
from tests.integration.fleet import fleet, fleet_client
from tests.integration.test_quotas import as_time, run, usage
from tokenbus.chunks import Chunk
from tokenbus_cli.stack import Stack, http_ok

__all__ = ["fleet", "fleet_client"]

TENANTS = [f"scale-{n:02d}" for n in range(20)]
TPM = 600  # conftest.TENANTS
SHORT = SamplingParams(max_tokens=22, ignore_eos=True)  # with the prompt "x": 24 tokens
WINDOW_S = 60.0
BRIDGE_TENANT = "scale-bridge"


async def through_bridges(ports: list[int], model: str, stop: asyncio.Event) -> list[Any]:
    """One completion at a time, each bridge in turn, until ``stop``: (port, status,
    request id, completion tokens the response reports)."""
    answers: list[Any] = []
    headers = {"Authorization": f"Bearer {bus_key(BRIDGE_TENANT)}"}
    body = {"model": model, "prompt": "x", "max_tokens": 8, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as http:
        while not stop.is_set():
            for port in ports:
                url = f"http://127.0.0.1:{port}/v1/completions"
                response = await http.post(url, headers=headers, json=body)
                usage = response.json().get("usage") if response.status_code == 200 else None
                answers.append(
                    (
                        port,
                        response.status_code,
                        response.headers.get("x-request-id"),
                        usage["completion_tokens"] if usage else None,
                    )
                )
            await asyncio.sleep(0.5)
    return answers


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

        ports = [fleet.service("bridge").port or 0, second_bridge.port or 0]
        bridges_done = asyncio.Event()
        bridged = asyncio.create_task(
            through_bridges(ports, settings.served_model_name, bridges_done)
        )
        per_second = 2 * TPM / 24 / WINDOW_S  # requests a second per tenant, at 2x TPM
        tasks: list[asyncio.Task[list[Chunk]]] = []
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
        bridges_done.set()
        answers = await bridged
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

        # Through the bridges: every request answered, once, billed as the response says.
        assert {port for port, *_ in answers} == set(ports)
        assert all(status == 200 for _, status, _, _ in answers), answers
        bridge_rows = await eventually(
            lambda: usage(settings, [BRIDGE_TENANT]),
            until=lambda r: len(r) >= len(answers),
            timeout_s=60,
        )
        assert Counter(r["request_id"] for r in bridge_rows) == Counter(
            rid for _, _, rid, _ in answers
        )
        assert {r["request_id"]: r["completion_tokens"] for r in bridge_rows} == {
            rid: tokens for _, _, rid, tokens in answers
        }

        errors, admitted_tokens = [], {}
        for tenant in TENANTS:
            admitted = [r for r in rows if r["tenant_id"] == tenant and r["status"] == "ok"]
            first = as_time(admitted[0]["created_at"])
            in_window = [
                r for r in admitted if as_time(r["created_at"]) < first + timedelta(seconds=59.9)
            ]
            tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in in_window)
            admitted_tokens[tenant] = tokens
            if not 0.99 * TPM <= tokens <= TPM:
                errors.append((tenant, tokens))
        print(
            f"scale-out: {len(tasks)} requests ({len(per_request)} billed once each, "
            f"{sum(delivered.values())} tokens delivered and billed), {len(answers)} through "
            f"the bridges; job instance stopped at {stopped_at:.0f} s and "
            f"started at {revived_at:.0f} s; tenants outside 1% of {TPM} TPM: {errors}"
        )
        worst = max(abs(t - TPM) / TPM for t in admitted_tokens.values())
        print(
            f"scale-out: admitted tokens in each tenant's first minute (limit {TPM}): "
            f"{admitted_tokens}; largest error {worst:.2%}; lost 0, run twice 0 "
            f"(one usage row for each of {len(per_request)} requests)"
        )
        assert not errors
    finally:
        for name in ("bridge-1", "stream_job-1"):
            fleet.remove(name)
