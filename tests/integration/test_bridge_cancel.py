"""Cancel through the bus: a client that leaves stops the worker, and billing shows it."""

from __future__ import annotations

import asyncio
import operator
import re
import time
from typing import Any

import httpx
import openai
from aiokafka import TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from billing.reader import open_reader
from producers import TokenbusClient
from schemas import (
    REASSIGNED,
    CancelRequest,
    FinishReason,
    InferenceRequest,
    SamplingParams,
    TokenChunk,
    TokenChunkBatch,
    decode,
    encode,
)
from tests.integration.conftest import (
    ADMIN_AUTH,
    BridgeProcess,
    bridge_key,
    engine_busy,
    eventually,
)
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer, make_producer
from tokenbus.topics import Topics
from tokenbus_cli.stack import Stack

MODEL = "tiny-llama"
MAX_TOKENS = 2000
DROP_MAX_TOKENS = 4000  # the default max_output_tokens is 4096
"""Far more than the engine makes while a cancel travels, however loaded the machine."""
MAX_TOKENS_AFTER_CANCEL = 1
"""Tokens a worker streams once it has the cancel: the engine step in flight, which is
one token of one request (no speculative decoding)."""
MAX_CANCEL_TRIP_S = 2.0
"""From the client's drop to the bridge's abort record, and from that record to the
worker's last chunk: the HTTP disconnect, the broker and one engine step, on a loaded
2-core machine. Without the cancel the request would run for all its tokens."""


def usage_row(settings: Settings, tenant: str, request_id: str) -> list[dict[str, Any]]:
    return open_reader(settings).query(
        "SELECT status, finish_reason, completion_tokens FROM usage_events FINAL "
        "WHERE tenant_id = {t:String} AND request_id = {r:String}",
        {"t": tenant, "r": request_id},
    )


def relayed_tokens(bridge: BridgeProcess, tenant: str) -> float:
    text = httpx.get(f"{bridge.url}/metrics", headers=ADMIN_AUTH).text
    match = re.search(
        rf'^tokenbus_bridge_tokens_relayed_total{{tenant="{re.escape(tenant)}"}} (\S+)$',
        text,
        re.MULTILINE,
    )
    return float(match.group(1)) if match else 0.0


def tokens_after_cancel(stack: Stack, tenant: str) -> tuple[float, float]:
    """The workers' ``tokenbus_worker_tokens_after_cancel`` for ``tenant``: (count, sum)."""
    count = total = 0.0
    for service in stack.services:
        if service.kind != "worker":
            continue
        port = service.env["TOKENBUS_WORKER_METRICS_PORT"]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        for family in text_string_to_metric_families(text):
            if family.name != "tokenbus_worker_tokens_after_cancel":
                continue
            for sample in family.samples:
                if sample.labels.get("tenant") != tenant:
                    continue
                if sample.name.endswith("_count"):
                    count += sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
    return count, total


async def worker_chunks(
    settings: Settings, reply_topic: str, request_id: str
) -> tuple[list[TokenChunk], float]:
    """Everything the worker sent for the request, read from the bridge's reply topic,
    and when the record with its last chunk was written (epoch s)."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    chunks: list[TokenChunk] = []
    last_at = 0.0
    try:
        tp = TopicPartition(reply_topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = time.monotonic() + 30
        while not (chunks and chunks[-1].is_last) and time.monotonic() < deadline:
            batches = await consumer.getmany(tp, timeout_ms=500)
            for record in batches.get(tp, []):
                batch = decode(TokenChunkBatch, record.value)
                mine = [c for c in batch.chunks if c.request_id == request_id]
                chunks += mine
                if mine and mine[-1].is_last:
                    last_at = record.timestamp / 1000
    finally:
        await consumer.stop()
    return chunks, last_at


async def abort_written_at(settings: Settings, tenant: str, request_id: str) -> float:
    """When the bridge wrote its abort for the request to the aborts topic (epoch s)."""
    topic = Topics(settings.topic_prefix).aborts
    consumer = make_consumer(settings, topic, group_id=None)
    await consumer.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    cancel = decode(CancelRequest, record.value)
                    if (cancel.tenant_id, cancel.request_id) == (tenant, request_id):
                        return float(record.timestamp / 1000)
    finally:
        await consumer.stop()
    raise AssertionError(f"no abort for {request_id} on {topic}")


async def test_a_client_that_drops_after_5_tokens_stops_the_worker(
    stack: Stack, bridge: BridgeProcess, settings: Settings
) -> None:
    tenant = "br-bob"
    before = await asyncio.to_thread(relayed_tokens, bridge, tenant)
    cancels_before = await asyncio.to_thread(tokens_after_cancel, stack, tenant)
    client = openai.AsyncOpenAI(
        base_url=f"{bridge.url}/v1", api_key=bridge_key(tenant), max_retries=0
    )
    # Idle, the tiny model makes the 4,000 tokens before the closed socket is noticed.
    async with engine_busy(settings):
        request_id, dropped_at = await _drop_after_5_chunks(client)

    rows = await eventually(lambda: usage_row(settings, tenant, request_id))
    health = (await asyncio.to_thread(httpx.get, f"{bridge.url}/healthz")).json()
    sent, ended_at = await worker_chunks(settings, health["reply_topic"], request_id)
    abort_at = await abort_written_at(settings, tenant, request_id)
    relayed = await asyncio.to_thread(relayed_tokens, bridge, tenant) - before
    count, after = map(
        operator.sub, await asyncio.to_thread(tokens_after_cancel, stack, tenant), cancels_before
    )
    billed = rows[0]["completion_tokens"]
    num_streamed = sum(c.num_tokens for c in sent)
    print(
        f"\nclient read 5 chunks; the bridge had sent it {relayed:.0f} tokens; the worker "
        f"streamed {num_streamed} in {len(sent)} chunks, {after:.0f} after it had the cancel; "
        f"billed {billed}; excess over sent {billed - relayed:.0f}; drop to abort record "
        f"{(abort_at - dropped_at) * 1000:.0f} ms, abort record to last chunk "
        f"{(ended_at - abort_at) * 1000:.0f} ms"
    )
    assert rows[0]["status"] == "cancelled"
    assert rows[0]["finish_reason"] == "abort"
    assert sent[-1].finish_reason is FinishReason.ABORT
    # Billed exactly what the engine generated: every token the worker streamed.
    assert billed == num_streamed
    assert relayed <= billed
    # The worker stopped within one engine step of having the cancel. Without it, the
    # request would have made all 4,000 tokens.
    assert count == 1
    assert after <= MAX_TOKENS_AFTER_CANCEL
    # What it made beyond what the bridge sent was in flight to the bridge, or made
    # while the cancel travelled: HTTP disconnect -> bridge -> aborts topic -> worker.
    # That trip is the broker's and the machine's, so it is bounded in time, not tokens.
    assert abort_at - dropped_at <= MAX_CANCEL_TRIP_S
    assert ended_at - abort_at <= MAX_CANCEL_TRIP_S


async def test_cancel_of_a_waiting_or_unstarted_request_never_runs_it(
    client: TokenbusClient, settings: Settings
) -> None:
    request = await client.submit(
        tenant_id="br-cancel-early",
        prompt="never mind",
        sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    await client.cancel(request)
    chunks = [chunk async for chunk in client.stream(request)]
    assert chunks[-1].finish_reason is FinishReason.ABORT
    rows = await eventually(lambda: usage_row(settings, "br-cancel-early", request.request_id))
    assert rows[0]["status"] == "cancelled"
    assert rows[0]["completion_tokens"] < MAX_TOKENS / 4


async def test_a_cancel_from_another_tenant_is_ignored(
    client: TokenbusClient, settings: Settings
) -> None:
    request: InferenceRequest = await client.submit(
        tenant_id="br-victim",
        prompt="keep going",
        sampling=SamplingParams(max_tokens=64, ignore_eos=True),
    )
    producer = make_producer(settings)
    await producer.start()
    chunks: list[Chunk] = []
    try:
        async for chunk in client.stream(request):
            chunks.append(chunk)
            if len(chunks) == 2:  # running on the worker: try to cancel it as another tenant
                cancels = Topics(settings.topic_prefix).cancels
                forged = CancelRequest(request_id=request.request_id, tenant_id="br-attacker")
                await producer.send_and_wait(cancels, encode(forged), key=b"br-attacker")
                # Naming the victim, with no credential, or with the job's own reason.
                for reason in ("client_cancelled", REASSIGNED):
                    claimed = CancelRequest(
                        request_id=request.request_id, tenant_id="br-victim", reason=reason
                    )
                    await producer.send_and_wait(cancels, encode(claimed), key=b"br-victim")
                # With the attacker's own valid credential, claiming the victim.
                await producer.send_and_wait(
                    cancels,
                    encode(claimed.model_copy(update={"reason": "client_cancelled"})),
                    key=b"br-victim",
                    headers=client.headers("br-attacker"),
                )
    finally:
        await producer.stop()
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert sum(c.num_tokens for c in chunks) == 64
    rows = await eventually(lambda: usage_row(settings, "br-victim", request.request_id))
    assert rows[0]["status"] == "ok" and rows[0]["completion_tokens"] == 64


async def _drop_after_5_chunks(client: openai.AsyncOpenAI) -> tuple[str, float]:
    """Streams a long completion and drops the connection after 5 token chunks; returns
    the request's ID and when the connection was closed (epoch s)."""
    try:
        raw = await client.completions.with_raw_response.create(
            model=MODEL,
            prompt="Tell me a long story.",
            max_tokens=DROP_MAX_TOKENS,
            stream=True,
            extra_body={"ignore_eos": True},  # only the cancel can end it early
        )
        request_id = raw.headers["x-request-id"]
        stream = raw.parse()
        received = 0
        async for _chunk in stream:
            received += 1
            if received == 5:
                break
        await stream.close()
        dropped_at = time.time()
    finally:
        await client.close()
    return str(request_id), dropped_at
