"""The job takes a prompt count from a record only when a tokenbus service vouched for it
on that very record (``tokenbus.prompt_vouch``); otherwise it counts the prompt itself.

Pure: a recording publisher, memory stores, real credentials. With no tokenizer file the
job's own count is its estimate from the UTF-8 length (one token per byte, plus one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from schemas.codec import decode
from schemas.fleet import WorkerStatus
from schemas.messages import WorkItem
from schemas.replies import TokenChunk
from stream_jobs.dispatcher import Dispatcher, Outcome, Record
from tests.unit.fakes import (
    SERVICE_SECRET,
    TOPICS,
    Recorder,
    bearer,
    memory_dispatcher,
    reply_topic,
    service_headers,
)
from tokenbus.config import Settings
from tokenbus.prompt_vouch import HEADER, vouch
from tokenbus.tenants import hash_api_key

KEY = "sk-acme-key"
PROMPT = "a prompt of forty-two bytes, or thereabout"  # the job's estimate: 43 tokens
TENANTS = f"""
[tenants.acme]
max_prompt_tokens = 10
api_key_sha256 = ["{hash_api_key(KEY)}"]
"""


@pytest.fixture
async def job(tmp_path: Path) -> AsyncIterator[tuple[Dispatcher, Recorder]]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    settings = Settings(
        home=tmp_path,
        tenants_file=tenants,
        bus_service_secret=SERVICE_SECRET,
        vip_reserve=0.0,
    )
    recorder = Recorder()
    dispatcher = memory_dispatcher(settings, recorder, allow_unlisted=False)
    status = WorkerStatus(
        worker_id="w",
        model="m",
        request_topic="tokenbus.worker.w",
        max_num_seqs=8,
        incarnation="run-1",
    )
    dispatcher.observe_heartbeat(orjson.dumps(status.model_dump(mode="json")))
    loop = asyncio.create_task(dispatcher.run())
    yield dispatcher, recorder
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)


def request(request_id: str) -> bytes:
    return orjson.dumps(
        {
            "request_id": request_id,
            "tenant_id": "acme",
            "model": "m",
            "prompt": PROMPT,
            "reply_to": reply_topic("acme"),
            "sampling": {"max_tokens": 8},
        }
    )


async def produce(
    job: tuple[Dispatcher, Recorder], value: bytes, headers: list[tuple[str, bytes]]
) -> tuple[Outcome, Any]:
    dispatcher, recorder = job
    outcome = await asyncio.wait_for(
        dispatcher.handle_request(Record("p", 0, 0, b"acme", value, headers)), 2
    )
    refusals = [c for c in recorder.chunks_on(reply_topic("acme")) if c.error is not None]
    return outcome, refusals[-1] if refusals else None


def too_long(chunk: TokenChunk | None) -> str:
    assert chunk is not None and chunk.error is not None
    assert chunk.error.code == "prompt_too_long"
    return chunk.error.message


async def test_the_bridge_s_vouched_count_is_the_count(job: tuple[Dispatcher, Recorder]) -> None:
    value = request("r1")
    headers = [*service_headers("acme"), (HEADER, vouch(SERVICE_SECRET, value, 9))]
    outcome, refused = await produce(job, value, headers)
    assert (outcome, refused) == (Outcome.FORWARDED, None)
    assert [item.request_id for item in map(forwarded, job[1].on("tokenbus.worker.w"))] == ["r1"]
    # It is believed both ways: a count above the tenant's limit is refused by it.
    value = request("r2")
    headers = [*service_headers("acme"), (HEADER, vouch(SERVICE_SECRET, value, 11))]
    assert "prompt has 11 tokens" in too_long((await produce(job, value, headers))[1])
    assert job[0].metrics.num_prompt_counts_vouched == 2
    assert job[0].metrics.num_prompt_vouches_refused == 0


@pytest.mark.parametrize(
    "forge",
    [
        # A producer with the tenant's own key, even with the bus's secret in hand: only
        # a service token's record is taken at its word.
        lambda value: [*bearer(KEY), (HEADER, vouch(SERVICE_SECRET, value, 9))],
        # The bridge's count for another request, copied onto this one.
        lambda value: [*service_headers("acme"), (HEADER, vouch(SERVICE_SECRET, b"{}", 9))],
        # Made with a secret that is not the bus's.
        lambda value: [*service_headers("acme"), (HEADER, vouch("guessed", value, 9))],
        # Not a vouch at all.
        lambda value: [*service_headers("acme"), (HEADER, b"9")],
    ],
)
async def test_any_other_count_on_a_record_is_not_believed(
    job: tuple[Dispatcher, Recorder], forge: Any
) -> None:
    value = request("r1")
    outcome, refused = await produce(job, value, forge(value))
    assert outcome is Outcome.REFUSED
    assert "prompt has 43 tokens" in too_long(refused)  # the job's own count
    assert job[1].on("tokenbus.worker.w") == [] and job[1].on(TOPICS.dead_letters) == []
    assert job[0].metrics.num_prompt_counts_vouched == 0
    assert job[0].metrics.num_prompt_vouches_refused == 1


async def test_without_a_vouch_the_job_counts(job: tuple[Dispatcher, Recorder]) -> None:
    outcome, refused = await produce(job, request("r1"), service_headers("acme"))
    assert outcome is Outcome.REFUSED and "prompt has 43 tokens" in too_long(refused)
    assert job[0].metrics.num_prompt_vouches_refused == 0


def forwarded(value: bytes) -> WorkItem:
    return decode(WorkItem, value)
