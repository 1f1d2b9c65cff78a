"""Faust's consumer thread drains only the partitions Faust has active, and none when it
has none (stream_jobs.faust_recovery), with a real aiokafka consumer on the stack's
broker.

Faust hands the thread its live set of active partitions and pauses partitions in it
while the fetch waits; aiokafka drains every partition for an empty set. A request
partition's records drained so are dropped by Faust (the partition is paused) after
aiokafka's position has moved past them: a restarted job then never takes them."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from types import SimpleNamespace
from typing import Any, cast

from aiokafka import TopicPartition
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

from stream_jobs import faust_recovery
from tokenbus.config import Settings
from tokenbus.kafka import delete_topics, ensure_topics, make_consumer, make_producer

GetMany = Callable[[Any, Any, float], Coroutine[Any, Any, Any]]


async def drained_while_paused(
    settings: Settings, getmany: GetMany, *, resume: bool = False
) -> tuple[Any, int]:
    """Faust asks for partition 1 (partition 0 paused), then pauses partition 1 too
    while the fetch waits (or, ``resume``, resumes partition 0), and a request arrives
    on partition 0. Returns what the fetch drained, and partition 0's position."""
    topic = f"{settings.topic_prefix}.test-intake-{uuid.uuid4().hex[:8]}"
    await ensure_topics(settings, {topic: 2})
    paused, asked = TopicPartition(topic, 0), TopicPartition(topic, 1)
    producer = make_producer(settings)
    consumer = make_consumer(settings, group_id=None)
    await producer.start()
    await consumer.start()
    try:
        consumer.assign([paused, asked])
        await consumer.seek_to_beginning(paused, asked)

        async def call_thread(fun: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
            return await fun(*args, **kw)  # Faust's consumer thread, run on this loop

        thread = SimpleNamespace(
            consumer=SimpleNamespace(flow_active=True),
            _ensure_consumer=lambda: consumer,
            call_thread=call_thread,
        )
        # The namespace stands in for Faust's consumer thread: what _fetch_records reads.
        fake_thread = cast(AIOKafkaConsumerThread, thread)
        thread._fetch_records = functools.partial(
            AIOKafkaConsumerThread._fetch_records, fake_thread
        )
        active = {asked}  # Faust's live set
        fetch = asyncio.create_task(getmany(thread, active, 3.0))
        await asyncio.sleep(0.5)  # the fetch waits: partition 1 holds nothing
        if resume:
            active.add(paused)  # Faust resumes partition 0
        else:
            active.clear()  # Faust pauses partition 1 as well
        await producer.send_and_wait(topic, b"a request", partition=0)
        records = await fetch
        return records, await consumer.position(paused)
    finally:
        await consumer.stop()
        await producer.stop()
        await delete_topics(settings, [topic])


async def test_a_partition_paused_while_the_fetch_waits_is_not_drained(
    settings: Settings,
) -> None:
    records, position = await drained_while_paused(settings, faust_recovery.getmany)
    assert records == {}
    assert position == 0  # the request is still there for when the partition resumes


async def test_faust_s_own_getmany_drains_the_paused_partition(settings: Settings) -> None:
    records, position = await drained_while_paused(settings, faust_recovery._getmany.original())
    assert [record.value for tp_records in records.values() for record in tp_records] == [
        b"a request"
    ]
    assert position == 1  # moved past a record Faust drops: the partition is paused


async def test_a_partition_resumed_while_the_fetch_waits_is_drained_at_once(
    settings: Settings,
) -> None:
    records, position = await drained_while_paused(settings, faust_recovery.getmany, resume=True)
    assert [record.value for tp_records in records.values() for record in tp_records] == [
        b"a request"
    ]
    assert position == 1
