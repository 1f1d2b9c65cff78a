"""A recovered table's changelog is not fetched (stream_jobs.faust_pauses): Faust's pause
of a changelog partition reaches aiokafka's fetcher, and any resume of Faust's undoes it.

With a real aiokafka consumer on the stack's broker under Faust's own
``pause_partitions`` and ``resume_partitions`` (the namespace holds only the state those
two read), and on the stack's running job, through its /metrics."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from stream_jobs import faust_pauses
from tests.integration.conftest import eventually
from tokenbus.config import Settings
from tokenbus.kafka import delete_topics, ensure_topics, make_consumer, make_producer

NUM_TABLES = 4
"""The job's changelog-backed tables: request-ledger, budget-spend, budget-reservations,
budget-fired (stream_jobs.app)."""


@pytest.fixture
async def consumer_on_two_topics(
    settings: Settings,
) -> AsyncIterator[tuple[AIOKafkaConsumer, Any, TopicPartition, TopicPartition]]:
    """A consumer assigned a changelog's partition and a stream's, one record in each,
    and Faust's consumer as ``faust_pauses`` reads it: its books and its thread."""
    suffix = uuid.uuid4().hex[:8]
    changelog = TopicPartition(f"{settings.topic_prefix}.test-pauses-{suffix}-changelog", 0)
    stream = TopicPartition(f"{settings.topic_prefix}.test-pauses-{suffix}", 0)
    await ensure_topics(settings, {changelog.topic: 1, stream.topic: 1})
    producer = make_producer(settings)
    consumer = make_consumer(settings, group_id=None)
    await producer.start()
    await consumer.start()
    try:
        for tp in (changelog, stream):
            await producer.send_and_wait(tp.topic, b"a record of " + tp.topic.encode(), partition=0)
        consumer.assign([changelog, stream])
        await consumer.seek_to_beginning(changelog, stream)
        active = {changelog, stream}
        faust = SimpleNamespace(
            _paused_partitions=set(),
            _get_active_partitions=lambda: active,
            _is_changelog_tp=lambda tp: tp.topic == changelog.topic,
            _thread=SimpleNamespace(_consumer=consumer, thread_loop=asyncio.get_running_loop()),
        )
        yield consumer, faust, changelog, stream
    finally:
        await consumer.stop()
        await producer.stop()
        await delete_topics(settings, [changelog.topic, stream.topic])


async def test_a_paused_changelog_is_left_out_of_the_fetches_until_resumed(
    consumer_on_two_topics: tuple[AIOKafkaConsumer, Any, TopicPartition, TopicPartition],
) -> None:
    consumer, faust, changelog, stream = consumer_on_two_topics
    faust_pauses.pause_partitions(faust, {changelog, stream})
    await asyncio.sleep(0)  # its turn on the consumer's loop
    assert consumer.paused() == {changelog}  # a stream partition stays Faust's alone

    faust_pauses.resume_partitions(faust, {stream})
    fetched = await consumer.getmany(timeout_ms=3_000)
    assert set(fetched) == {stream}
    await asyncio.sleep(1.0)  # more fetches go by
    assert changelog not in consumer._fetcher._records  # never asked for, nothing held
    assert await consumer.position(changelog) == 0

    faust_pauses.resume_partitions(faust, {changelog})
    fetched = await eventually_fetched(consumer)
    assert [record.value for record in fetched[changelog]] == [
        b"a record of " + changelog.topic.encode()
    ]
    assert consumer.paused() == set()


async def test_a_resume_made_before_the_pause_s_turn_wins(
    consumer_on_two_topics: tuple[AIOKafkaConsumer, Any, TopicPartition, TopicPartition],
) -> None:
    consumer, faust, changelog, _ = consumer_on_two_topics
    faust_pauses.pause_partitions(faust, {changelog})
    faust_pauses.resume_partitions(faust, {changelog})  # before the loop runs the pause
    await asyncio.sleep(0)
    assert consumer.paused() == set()
    fetched = await eventually_fetched(consumer)
    assert changelog in fetched


async def test_a_partition_faust_let_go_of_before_the_pause_s_turn_is_not_paused(
    consumer_on_two_topics: tuple[AIOKafkaConsumer, Any, TopicPartition, TopicPartition],
) -> None:
    consumer, faust, changelog, _ = consumer_on_two_topics
    faust_pauses.pause_partitions(faust, {changelog})
    faust._paused_partitions.discard(changelog)  # as Faust's on_partitions_revoked does
    await asyncio.sleep(0)
    assert consumer.paused() == set()


async def eventually_fetched(consumer: AIOKafkaConsumer) -> dict[TopicPartition, list[Any]]:
    for _ in range(10):
        fetched: dict[TopicPartition, list[Any]] = await consumer.getmany(timeout_ms=1_000)
        if fetched:
            return fetched
    raise AssertionError("nothing fetched in 10 s")


def job_partitions(settings: Settings) -> dict[tuple[str, str], float]:
    text = httpx.get(f"http://127.0.0.1:{settings.faust_web_port}/metrics", timeout=10).text
    return {
        (sample.labels["role"], sample.labels["fetched"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenbus_job_partitions"
    }


async def test_the_running_job_fetches_its_streams_and_none_of_its_changelogs(
    settings: Settings,
) -> None:
    changelogs = NUM_TABLES * settings.num_partitions
    counts = await eventually(
        lambda: job_partitions(settings),
        until=lambda c: c.get(("changelog", "false")) == changelogs,
    )
    assert counts[("changelog", "true")] == 0
    # requests p0..p2, usage and cancels, and Faust's leader topic: all fetched
    assert counts[("stream", "true")] == 5 * settings.num_partitions + 1
    assert counts[("stream", "false")] == 0
