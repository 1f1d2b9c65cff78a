"""A consumer that expects a record fetches with the short wait until it comes
(tokenbus.tansu.fetch_wait), on the stack's broker: the bundled one looks at a parked
fetch only now and then, so a record that lands early in a long fetch waits for it. A
client expects its first chunk only while its requests come one at a time."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

import producers.client
from producers import TokenbusClient
from schemas import SamplingParams
from tokenbus.config import Settings
from tokenbus.kafka import delete_topics, ensure_topics, make_consumer, make_producer
from tokenbus.tansu.fetch_wait import expect_records

BASE_MS = 100
"""Long, so that the broker's late look at a parked fetch stands out from the noise."""
ROUNDS = 8


async def delivered_ms(
    consumer: AIOKafkaConsumer, producer: AIOKafkaProducer, tp: TopicPartition, hint: bool
) -> float:
    if hint:
        expect_records(consumer)
    await asyncio.sleep(1.2 * BASE_MS / 1000)  # the fetch parked before the hint has ended
    sent = time.monotonic()
    await producer.send_and_wait(tp.topic, b"x")
    while not (await consumer.getmany(tp, timeout_ms=1_000)).get(tp):
        pass
    return 1000 * (time.monotonic() - sent)


async def test_an_expected_record_is_fetched_without_waiting_for_the_broker_to_look(
    settings: Settings,
) -> None:
    assert settings.broker_profile == "tansu"
    settings = settings.model_copy(update={"eager_fetch_window_ms": 2_000})
    topic = f"{settings.topic_prefix}.test-eager-fetch-{uuid.uuid4().hex[:8]}"
    await ensure_topics(settings, {topic: 1})
    tp = TopicPartition(topic, 0)
    consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=BASE_MS)
    producer = make_producer(settings, linger_ms=0)
    await consumer.start()
    await producer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        hinted: list[float] = []
        plain: list[float] = []
        for _ in range(ROUNDS):
            hinted.append(await delivered_ms(consumer, producer, tp, hint=True))
            fetcher = consumer._fetcher
            assert fetcher is not None
            assert fetcher._fetch_max_wait_ms == BASE_MS  # the record came: the wait is back
            plain.append(await delivered_ms(consumer, producer, tp, hint=False))
    finally:
        await producer.stop()
        await consumer.stop()
        await delete_topics(settings, [topic])
    hinted_ms, plain_ms = statistics.median(hinted), statistics.median(plain)
    assert hinted_ms < 0.25 * BASE_MS and hinted_ms < 0.5 * plain_ms, (hinted, plain)


async def test_a_client_expects_its_first_chunk_only_while_requests_come_one_at_a_time(
    client: TokenbusClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    hinted: list[object] = []
    expect = expect_records  # what the client calls, as it ships

    def spy(consumer: object) -> None:
        hinted.append(consumer)
        expect(consumer)

    monkeypatch.setattr(producers.client, "expect_records", spy)

    async def run(*prompts: str) -> None:
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        requests = [
            await client.submit(tenant_id="eager-fetch", prompt=prompt, sampling=sampling)
            for prompt in prompts
        ]
        for request in requests:
            assert [chunk async for chunk in client.stream(request)]

    await run("alone")
    assert hinted == [client.reply_consumer]
    await run("first of two", "second, while the first runs")  # only the first is hinted
    assert len(hinted) == 2
    await run("after two at once")  # the last spell was not one at a time
    assert len(hinted) == 2
    await run("alone again")
    assert len(hinted) == 3
