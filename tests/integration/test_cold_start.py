"""Unknown capacity is not overload: a job that has seen no heartbeat yet holds requests
of every class, sheds and caps none, and logs no tier change; a worker then serves them.

A second Faust job, with its own topics, app id and home, runs on the session's broker,
so it starts with no worker at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from producers import TokenbusClient
from schemas import FinishReason, InferenceRequest, SamplingParams
from tests.integration.test_quotas import job_metrics
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics
from tokenbus_cli.stack import Service, Stack, free_port, stack_topics

TENANTS_BY_CLASS = {0: "vip", 1: "tier-std", 2: "batch"}  # from the session's tenants file
NUM_PER_CLASS = 8  # 24 waiting on no capacity: demand would have read as infinite
MAX_TOKENS = 300  # above the cap tier's 256, so a cap would show


async def collect(client: TokenbusClient, request: InferenceRequest) -> list[Chunk]:
    return [chunk async for chunk in client.stream(request)]


@contextlib.asynccontextmanager
async def cold_job(
    stack: Stack, home: Path, *, dead_after_s: float
) -> AsyncIterator[tuple[Settings, Service, dict[str, Any]]]:
    """A Faust job of its own on the session's broker, which no worker has ever served."""
    stack.check()
    tag = uuid.uuid4().hex[:8]
    overrides: dict[str, Any] = {
        "topic_prefix": f"cold{tag}",
        "faust_app_id": f"tokenbus-cold-{tag}",
        "faust_web_port": free_port(),
        "home": home,
        "worker_dead_after_s": dead_after_s,
        # A client waits as long as the job holds its request (a vLLM start, here).
        "client_timeout_s": 300.0,
    }
    settings = stack.settings.model_copy(update=overrides)
    await ensure_topics(settings, stack_topics(settings))
    job = stack.add_job(f"cold-job-{tag}", **overrides)
    try:
        await stack.wait_ready(job, 120)
        yield settings, job, overrides
    finally:
        for name in [s.name for s in stack.services if tag in s.name]:
            stack.remove(name)


async def submit_every_class(client: TokenbusClient) -> list[InferenceRequest]:
    return [
        await client.submit(
            tenant_id=tenant,
            prompt=f"class {priority} request {i}",
            priority=priority,
            sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        for priority, tenant in TENANTS_BY_CLASS.items()
        for i in range(NUM_PER_CLASS)
    ]


def assert_no_tier_engaged(settings: Settings, job: Service) -> None:
    metrics = job_metrics(settings)
    assert metrics["tokenbus_job_num_shed_total"] == 0
    assert metrics["tokenbus_job_num_capped_total"] == 0
    assert metrics["tokenbus_job_num_tier_changes_total"] == 0
    assert "overload tier" not in job.log_path.read_text(errors="replace")


async def test_requests_before_any_heartbeat_wait_and_none_is_shed_or_capped(
    stack: Stack, tmp_path: Path
) -> None:
    # The wait is long enough for a vLLM engine to start, on a machine the rest of the
    # suite loads too (160 s seen in a full run): requests wait, then are served.
    async with cold_job(stack, tmp_path, dead_after_s=300.0) as (settings, job, overrides):
        async with TokenbusClient(settings) as client:
            requests = await submit_every_class(client)
            streams = [asyncio.create_task(collect(client, r)) for r in requests]
            await asyncio.sleep(3.0)  # the job has taken them in: they wait, unanswered
            assert not any(s.done() for s in streams)

            await stack.add_worker(f"cold-worker-{overrides['faust_app_id']}", **overrides)
            results = await asyncio.wait_for(asyncio.gather(*streams), timeout=360)

        for request, chunks in zip(requests, results, strict=True):
            last = chunks[-1]
            assert last.error is None, (request.tenant_id, last.error)
            assert last.finish_reason is FinishReason.LENGTH
            assert sum(c.num_tokens for c in chunks) == MAX_TOKENS  # not capped
        assert_no_tier_engaged(settings, job)


async def test_with_no_worker_after_the_wait_interactive_classes_get_no_worker_and_batch_waits(
    stack: Stack, tmp_path: Path
) -> None:
    async with cold_job(stack, tmp_path, dead_after_s=2.0) as (settings, job, _):
        async with TokenbusClient(settings) as client:
            requests = await submit_every_class(client)
            interactive = [r for r in requests if r.priority < 2]
            batch = [r for r in requests if r.priority == 2]
            results = await asyncio.wait_for(
                asyncio.gather(*(collect(client, r) for r in interactive)), timeout=60
            )
            for request, chunks in zip(interactive, results, strict=True):
                error = chunks[-1].error
                assert error is not None and error.code == "no_worker", (request.tenant_id, error)
            # Batch lines wait for a worker rather than fail; cancelled, they are dropped.
            waiting = [asyncio.ensure_future(collect(client, r)) for r in batch]
            done, _ = await asyncio.wait(waiting, timeout=5)
            assert not done, [t.result() for t in done]
            for request in batch:
                await client.cancel(request)
            ended = await asyncio.wait_for(asyncio.gather(*waiting), timeout=60)
            for chunks in ended:
                assert chunks[-1].finish_reason is FinishReason.ABORT, chunks[-1]
        assert_no_tier_engaged(settings, job)
