"""A consumer keeps reading a partition whose fetches cost the broker more than the
consumer's fetch wait (tokenbus.tansu.fetch_wait), on the stack's broker."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiokafka import TopicPartition

from tokenbus.config import Settings
from tokenbus.kafka import delete_topics, ensure_topics, make_consumer, make_producer

BATCHES = 5_000
PRODUCERS = 4


async def fill(settings: Settings, topic: str) -> None:
    """``BATCHES`` records, each in a batch of its own, as reply topics are written."""

    async def one(index: int) -> None:
        producer = make_producer(settings, linger_ms=0)
        await producer.start()
        try:
            for n in range(index, BATCHES, PRODUCERS):
                await producer.send_and_wait(topic, str(n).encode())
        finally:
            await producer.stop()

    await asyncio.gather(*(one(i) for i in range(PRODUCERS)))


async def test_a_consumer_lengthens_its_wait_until_the_broker_answers(settings: Settings) -> None:
    topic = f"{settings.topic_prefix}.test-fetch-wait-{uuid.uuid4().hex[:8]}"
    await ensure_topics(settings, {topic: 1})
    tp = TopicPartition(topic, 0)
    try:
        await fill(settings, topic)
        # 1 ms is less than one fetch of 5,000 batches costs the bundled broker: a
        # consumer that kept it would get empty fetches forever.
        consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=1)
        await consumer.start()
        try:
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            seen: set[bytes] = set()
            deadline = time.monotonic() + 60
            while len(seen) < BATCHES and time.monotonic() < deadline:
                batches = await consumer.getmany(tp, timeout_ms=500)
                seen |= {record.value for record in batches.get(tp, []) if record.value}
            fetcher = consumer._fetcher
            assert fetcher is not None
            wait_ms = fetcher._fetch_max_wait_ms
        finally:
            await consumer.stop()
        assert len(seen) == BATCHES, f"read {len(seen)} of {BATCHES} records; wait {wait_ms} ms"
        assert 1 < wait_ms <= settings.fetch_max_wait_cap_ms
    finally:
        await delete_topics(settings, [topic])
