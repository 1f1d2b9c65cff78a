"""A client's reply topics roll on the bundled broker, and no chunk is lost on the way."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from producers import TokenbusClient, reply_topics
from schemas import FinishReason, InferenceRequest, SamplingParams
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer


async def topic_names(settings: Settings) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def end_offsets(settings: Settings, topics: list[str]) -> dict[str, int]:
    if not topics:
        return {}
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(t, 0) for t in topics]
        consumer.assign(tps)
        return {tp.topic: n for tp, n in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def test_replies_move_to_fresh_topics_and_the_old_ones_go(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert settings.broker_profile == "tansu"  # the integration stack's broker
    monkeypatch.setattr(reply_topics, "RETIRE_AFTER_S", 0.5)
    rolling = settings.model_copy(update={"reply_topic_roll_records": 6})
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    async with TokenbusClient(rolling) as client:
        base = client.reply_prefix
        assert base.endswith(".") and client.reply_topic == f"{base}0"
        used = []
        for n in range(6):
            # Two at a time: one may start on a topic the other's stream ends on.
            pair = [
                await client.submit(tenant_id="tenant-a", prompt=f"roll {n} {i}", sampling=sampling)
                for i in range(2)
            ]
            streams = await asyncio.wait_for(
                asyncio.gather(*(_collect(client, r) for r in pair)), 60
            )
            for request, chunks in zip(pair, streams, strict=True):
                used.append(request.reply_to)
                assert [c.seq for c in chunks] == list(range(len(chunks)))
                assert chunks[-1].finish_reason is FinishReason.LENGTH, chunks[-1]
                assert sum(c.num_tokens for c in chunks) == 8
        # Every reply topic is under the client's prefix, which its tokens name.
        assert all(t.startswith(base) for t in used)
        assert len(set(used)) >= 3, used  # it rolled, more than once
        # Every chunk came through the reader, none from reading a topic back.
        missed = [r.getMessage() for r in caplog.records if "had not delivered" in r.getMessage()]
        assert not missed, missed
        consumer = client.reply_consumer
        assert consumer is not None
        # The reader lets the old topics go after its next fetches. It may also move on
        # once more meanwhile: the last fetches can show the current topic full, with
        # the next one made ahead, after the last stream ended.
        for _ in range(100):
            if {tp.topic for tp in consumer.assignment()} == {client.reply_topic}:
                break
            await asyncio.sleep(0.1)
        current = client.reply_topic
        assert current != f"{base}0"
        assert {tp.topic for tp in consumer.assignment()} == {current}
        # Deleted, and once every producer that wrote there let it go, deleted again:
        # gone for good, not made again empty by a producer's metadata refresh.
        old = sorted((set(used) | {f"{base}0"}) - {current})
        left = old
        for _ in range(int(2 * settings.reply_topic_forget_s + 15) * 2):
            left = [t for t in old if t in await topic_names(settings)]
            if not left:
                break
            await asyncio.sleep(0.5)
        assert not left, left
        # A fresh request after that (workers and job refresh their metadata) brings
        # none of them back.
        request = await client.submit(tenant_id="tenant-a", prompt="after", sampling=sampling)
        assert sum(c.num_tokens for c in await _collect(client, request)) == 8
        assert not [t for t in old if t in await topic_names(settings)]
    # Closed: each of its topics deleted.
    left = sorted(t for t in await topic_names(settings) if t.startswith(base))
    assert left != sorted({*used, current}), "none was deleted"
    assert all(n == 0 for n in (await end_offsets(settings, left)).values()), left


async def _collect(client: TokenbusClient, request: InferenceRequest) -> list[Chunk]:
    return [chunk async for chunk in client.stream(request)]
