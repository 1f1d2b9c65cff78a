"""One request end to end: client -> Kafka -> Faust job -> vLLM worker -> reply -> ClickHouse."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
from aiokafka import TopicPartition

from billing.reader import open_reader
from producers import TokenbusClient
from schemas import (
    DeadLetter,
    FinishReason,
    InferenceRequest,
    SamplingParams,
    decode,
    encode,
)
from tests.integration.conftest import QUOTA_TENANT, bus_key, eventually, rows_by
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus.ids import new_request_id, new_session_id
from tokenbus.kafka import make_consumer, make_producer
from tokenbus.topics import Topics


async def collect(client: TokenbusClient, request: InferenceRequest) -> list[Chunk]:
    return [chunk async for chunk in client.stream(request)]


def usage_rows(settings: Settings, request_ids: list[str]) -> list[dict[str, Any]]:
    return open_reader(settings).query(
        "SELECT request_id, tenant_id, status, completion_tokens, prompt_tokens "
        "FROM usage_events FINAL WHERE request_id IN {ids:Array(String)}",
        {"ids": request_ids},
    )


async def test_concurrent_requests_stream_to_completion_and_bill_exactly(
    client: TokenbusClient, settings: Settings
) -> None:
    rng = random.Random(7)
    tenants = ["tenant-a", "tenant-b", "tenant-c"]
    requests = [
        await client.submit(
            tenant_id=tenants[i % 3],
            prompt=f"Request {i}: tell me about Kafka partitions and tenants. " * rng.randint(1, 4),
            priority=i % 3,
            sampling=SamplingParams(max_tokens=rng.randint(4, 40), ignore_eos=i % 2 == 0),
        )
        for i in range(20)
    ]
    streams = await asyncio.gather(*(collect(client, r) for r in requests))

    received: dict[str, int] = {}
    for request, chunks in zip(requests, streams, strict=True):
        assert [c.seq for c in chunks] == list(range(len(chunks))), "gap or repeat in seq"
        last = chunks[-1]
        assert last.error is None, last.error
        assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        received[request.request_id] = sum(c.num_tokens for c in chunks)
        assert received[request.request_id] == sum(len(c.token_ids) for c in chunks)
        assert 1 <= received[request.request_id] <= request.sampling.max_tokens
        if request.sampling.ignore_eos:
            assert received[request.request_id] == request.sampling.max_tokens

    rows = await eventually(
        lambda: usage_rows(settings, list(received)), until=lambda r: len(r) == len(received)
    )
    billed = rows_by(rows, "request_id")
    for request in requests:
        row = billed[request.request_id]
        assert row["tenant_id"] == request.tenant_id
        assert row["status"] == "ok"
        assert row["completion_tokens"] == received[request.request_id]
        assert row["prompt_tokens"] > 0


async def test_request_over_quota_gets_a_rejection_chunk(
    client: TokenbusClient, settings: Settings
) -> None:
    # Each request reserves its prompt (2 tokens) plus max_tokens: the first fits in the
    # tenant's 120 tokens a minute, the second would not.
    sampling = SamplingParams(max_tokens=60, ignore_eos=True)
    first = await client.submit(tenant_id=QUOTA_TENANT, prompt="a", sampling=sampling)
    assert (await collect(client, first))[-1].error is None
    request = await client.submit(tenant_id=QUOTA_TENANT, prompt="a", sampling=sampling)
    chunks = await asyncio.wait_for(collect(client, request), timeout=10)

    assert len(chunks) == 1
    (chunk,) = chunks
    assert chunk.finish_reason is FinishReason.REJECTED
    assert chunk.error is not None and chunk.error.code == "quota_exceeded"
    assert chunk.error.retry_after_s is not None and 0 < chunk.error.retry_after_s <= 60
    assert QUOTA_TENANT in chunk.error.message

    too_big = await client.submit(
        tenant_id=QUOTA_TENANT, prompt="a", sampling=SamplingParams(max_tokens=500)
    )
    (never,) = await asyncio.wait_for(collect(client, too_big), timeout=10)
    assert never.error is not None and never.error.code == "quota_exceeded"
    assert "more than the 120 per minute" in never.error.message

    rows = await eventually(lambda: usage_rows(settings, [request.request_id]))
    assert rows[0]["status"] == "rejected"
    assert rows[0]["completion_tokens"] == 0


async def test_unknown_model_is_answered_not_held(client: TokenbusClient) -> None:
    request = await client.submit(tenant_id="tenant-a", prompt="hi", model="no-such-model")
    chunks = await asyncio.wait_for(collect(client, request), timeout=10)

    assert chunks[-1].error is not None
    assert chunks[-1].error.code == "no_worker"
    assert "no-such-model" in chunks[-1].error.message


async def test_malformed_requests_go_to_the_dead_letter_topic_and_serving_goes_on(
    client: TokenbusClient, settings: Settings
) -> None:
    topics = Topics(settings.topic_prefix)
    marker = new_request_id()
    future_version = orjson.dumps({"schema_version": 99, "request_id": marker})
    valid_but_incomplete = orjson.dumps({"request_id": marker, "tenant_id": "tenant-a"})
    producer = make_producer(settings)
    await producer.start()
    try:
        for payload in (b"\xff not json " + marker.encode(), future_version, valid_but_incomplete):
            await producer.send_and_wait(topics.requests(1), payload, key=b"tenant-a")
    finally:
        await producer.stop()

    consumer = make_consumer(settings, topics.dead_letters, group_id=None)
    await consumer.start()
    letters: list[DeadLetter] = []
    try:

        async def read_three() -> None:
            async for record in consumer:
                letter = decode(DeadLetter, record.value)
                if marker in letter.payload:
                    letters.append(letter)
                    if len(letters) == 3:
                        return

        await asyncio.wait_for(read_three(), timeout=30)
    finally:
        await consumer.stop()

    # The job handles requests concurrently: order the letters by their source offset.
    reasons = [letter.reason for letter in sorted(letters, key=lambda letter: letter.offset)]
    assert reasons[0].startswith("not JSON")
    assert "unknown schema_version 99" in reasons[1]
    assert "model" in reasons[2] and "Field required" in reasons[2]
    assert all(letter.source_topic == topics.requests(1) for letter in letters)

    # The job goes on serving after the bad messages.
    request = await client.submit(
        tenant_id="tenant-a", prompt="still there?", sampling=SamplingParams(max_tokens=5)
    )
    chunks = await asyncio.wait_for(collect(client, request), timeout=60)
    assert chunks[-1].error is None
    assert chunks[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_request_produced_by_another_program_is_served(settings: Settings) -> None:
    """Any program may produce to the request topics; here a raw aiokafka producer does,
    with its tenant's API key in the record's authorization header."""
    key = bus_key("tenant-raw")
    async with TokenbusClient(settings, tenant_id="tenant-raw", credential=key) as client:
        request = InferenceRequest(
            request_id=new_request_id(),
            session_id=new_session_id(),
            tenant_id="tenant-raw",
            priority=0,
            model=settings.served_model_name,
            messages=[{"role": "user", "content": "Hello from a chat message"}],  # type: ignore[list-item]
            sampling=SamplingParams(max_tokens=6, ignore_eos=True),
            reply_to=client.reply_topic,
        )
        client.watch(request.request_id, "tenant-raw")
        producer = make_producer(settings)
        await producer.start()
        try:
            await producer.send_and_wait(
                Topics(settings.topic_prefix).requests(0),
                encode(request),
                key=b"tenant-raw",
                headers=[("authorization", f"Bearer {key}".encode())],
            )
        finally:
            await producer.stop()
        chunks = await asyncio.wait_for(collect(client, request), timeout=60)
    assert sum(c.num_tokens for c in chunks) == 6
    assert chunks[-1].finish_reason is FinishReason.LENGTH


async def test_a_stream_whose_reply_reader_missed_its_records_reads_them_back(
    settings: Settings,
) -> None:
    # The client's reply reader is held back until the request has finished and been
    # billed, then moved past its records, as a broker that showed them late would:
    # the stream still gets every chunk, in order, by reading the topic back.
    quiet = settings.model_copy(update={"client_quiet_s": 1.0})
    async with TokenbusClient(quiet) as client:
        reader = client._consumer
        assert reader is not None
        tp = TopicPartition(client.reply_topic, 0)
        reader.pause(tp)
        request = await client.submit(
            tenant_id="read-back",
            prompt="hello",
            sampling=SamplingParams(max_tokens=24, ignore_eos=True),
        )
        await eventually(lambda: usage_rows(settings, [request.request_id]))
        await reader.seek_to_end(tp)
        reader.resume(tp)
        chunks = await asyncio.wait_for(collect(client, request), timeout=30)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].is_last and sum(c.num_tokens for c in chunks) == 24
