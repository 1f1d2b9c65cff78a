"""An idle client does not fetch its reply topic (producers.client): with no stream open
its reader pauses, and a stream watched before its request is sent starts it again,
on the real stack. A record that came while it was paused is read then, not lost, and
old reply topics are still let go of while it is paused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from aiokafka import TopicPartition

from producers import TokenbusClient, reply_topics
from schemas import SamplingParams
from tokenbus.config import Settings
from tokenbus.kafka import make_producer

TENANT = "idle-client"


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met within the time"
        await asyncio.sleep(0.05)


async def test_an_idle_client_fetches_no_replies_until_a_stream_opens(settings: Settings) -> None:
    async with TokenbusClient(settings) as client:
        consumer = client.reply_consumer
        assert consumer is not None
        tp = TopicPartition(client.reply_topic, 0)
        await until(lambda: consumer.paused() == {tp})  # nothing open: not fetched
        start = await consumer.position(tp)

        producer = make_producer(settings)
        await producer.start()
        try:  # a stray record while idle: not a reply batch, dead-lettered once read
            await producer.send_and_wait(client.reply_topic, b"not a batch", key=b"x")
        finally:
            await producer.stop()
        await asyncio.sleep(1.0)  # fifty fetch waits
        assert await consumer.position(tp) == start  # not fetched while idle
        assert consumer.paused() == {tp}

        request = await client.submit(
            tenant_id=TENANT, prompt="a", sampling=SamplingParams(max_tokens=4, ignore_eos=True)
        )
        chunks = [c async for c in client.stream(request)]
        assert chunks[-1].is_last and chunks[-1].error is None
        assert sum(c.num_tokens for c in chunks) == 4
        assert await consumer.position(tp) > start + 1  # the stray record and the replies

        await until(lambda: consumer.paused() == {tp})  # idle again once the stream ended


async def test_an_idle_client_still_lets_go_of_its_old_reply_topics(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reply_topics, "RETIRE_AFTER_S", 2.0)
    rolling = settings.model_copy(update={"reply_topic_roll_records": 6})
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    async with TokenbusClient(rolling) as client:
        first = client.reply_topic
        for n in range(20):  # until the replies have moved on: then no more streams
            request = await client.submit(tenant_id=TENANT, prompt=f"roll {n}", sampling=sampling)
            assert [c async for c in client.stream(request)][-1].is_last
            if client.reply_topic != first:
                break
        assert client.reply_topic != first, "the replies never moved to a fresh topic"
        consumer = client.reply_consumer
        assert consumer is not None
        current = TopicPartition(client.reply_topic, 0)
        # Idle from here on: the old topic is let go of two seconds after the move, by
        # the paused reader's housekeeping, and it reads only the current one, paused.
        await until(lambda: consumer.assignment() == {current}, timeout_s=15.0)
        await until(lambda: consumer.paused() == {current})
