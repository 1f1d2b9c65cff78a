"""The reply batcher against a fake producer that records sends and acks on demand."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from schemas import TokenChunkBatch, decode
from tokenbus.chunks import Chunk
from tokenbus.span_path import path_ns
from workers.replies import ReplyBatcher


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, TokenChunkBatch]] = []
        self.acks: list[asyncio.Future[None]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.error: Exception | None = None
        self.headers: list[list[tuple[str, bytes]]] = []

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future[Any]:
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        self.sent.append((topic, key, decode(TokenChunkBatch, value)))
        self.headers.append(list(headers or []))
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        return ack

    def ack_all(self) -> None:
        for ack in self.acks:
            if not ack.done():
                ack.set_result(None)

    def layout(self) -> list[tuple[str, bytes, list[tuple[str, int]]]]:
        """Each record as (topic, key, [(request_id, seq), ...])."""
        return [
            (topic, key, [(c.request_id, c.seq) for c in batch.chunks])
            for topic, key, batch in self.sent
        ]


def chunk(request_id: str, seq: int, tenant: str = "t") -> Chunk:
    return Chunk(
        request_id=request_id, tenant_id=tenant, seq=seq, text="x", token_ids=[1], num_tokens=1
    )


async def next_iterations(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_one_engine_step_makes_one_record_per_topic_and_tenant() -> None:
    producer = FakeProducer()
    batcher = ReplyBatcher(producer)
    step = asyncio.Event()  # vLLM's output handler wakes every stream of a step at once

    async def stream(topic: str, request_id: str, tenant: str) -> asyncio.Future[int]:
        await step.wait()
        return batcher.add(topic, chunk(request_id, 0, tenant))

    streams = [
        asyncio.create_task(stream(topic, request_id, tenant))
        for topic, request_id, tenant in [
            ("c1", "r1", "a"),
            ("c1", "r2", "b"),
            ("c1", "r3", "a"),
            ("c2", "r4", "a"),
        ]
    ]
    await asyncio.sleep(0)
    step.set()
    await asyncio.gather(*streams)
    await next_iterations()
    assert producer.layout() == [
        ("c1", b"a", [("r1", 0), ("r3", 0)]),
        ("c1", b"b", [("r2", 0)]),
        ("c2", b"a", [("r4", 0)]),
    ]
    assert all(batch.tenant_id == key.decode() for _, key, batch in producer.sent)


async def test_each_loop_iteration_flushes_once_and_keeps_the_order() -> None:
    producer = FakeProducer()
    batcher = ReplyBatcher(producer)
    batcher.add("c1", chunk("r1", 0))
    batcher.add("c1", chunk("r1", 1))
    assert producer.sent == []  # nothing goes before the iteration is over
    await asyncio.sleep(0)
    batcher.add("c1", chunk("r1", 2))
    await next_iterations()
    assert producer.layout() == [
        ("c1", b"t", [("r1", 0), ("r1", 1)]),
        ("c1", b"t", [("r1", 2)]),
    ]


async def test_a_later_record_never_overtakes_one_whose_send_waits() -> None:
    producer = FakeProducer()
    producer.gate.clear()  # the first send waits, e.g. for the topic's metadata
    batcher = ReplyBatcher(producer)
    batcher.add("c1", chunk("r1", 0))
    await next_iterations()
    batcher.add("c1", chunk("r1", 1))
    await next_iterations()
    assert producer.sent == []
    producer.gate.set()
    await next_iterations()
    assert producer.layout() == [("c1", b"t", [("r1", 0)]), ("c1", b"t", [("r1", 1)])]


class OneTopicWaits(FakeProducer):
    """A send to ``waiting`` waits (for the metadata of a topic that is gone, on a broker
    that does not make topics on demand) until ``gate`` is set; the others go at once."""

    def __init__(self, waiting: str) -> None:
        super().__init__()
        self.waiting = waiting
        self.gate.clear()

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future[Any]:
        if topic != self.waiting:
            self.sent.append((topic, key, decode(TokenChunkBatch, value)))
            ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            ack.set_result(None)
            return ack
        return await super().send(topic, value, key, headers)


async def test_a_topic_whose_send_waits_holds_up_no_other_topic() -> None:
    producer = OneTopicWaits("gone")
    batcher = ReplyBatcher(producer)
    stuck = batcher.add("gone", chunk("r1", 0, tenant="eve"))
    batcher.add("gone", chunk("r1", 1, tenant="eve"))
    await next_iterations()
    others = [batcher.add("c1", chunk("r2", n, tenant="alice")) for n in range(2)]
    await next_iterations()
    later = batcher.add("c1", chunk("r2", 2, tenant="alice"))
    await next_iterations()
    assert producer.layout() == [
        ("c1", b"alice", [("r2", 0), ("r2", 1)]),
        ("c1", b"alice", [("r2", 2)]),
    ]
    assert all(f.done() for f in [*others, later]) and not stuck.done()
    producer.gate.set()
    await batcher.drain()
    producer.ack_all()
    await next_iterations()
    assert producer.layout()[-1] == ("gone", b"eve", [("r1", 0), ("r1", 1)])
    assert stuck.done()


async def test_futures_resolve_when_their_record_is_acknowledged() -> None:
    producer = FakeProducer()
    batcher = ReplyBatcher(producer)
    first = [batcher.add("c1", chunk("r1", 0)), batcher.add("c1", chunk("r2", 0))]
    await next_iterations()
    second = batcher.add("c1", chunk("r1", 1))
    await next_iterations()
    assert len(producer.acks) == 2 and not any(f.done() for f in [*first, second])
    producer.acks[0].set_result(None)
    await next_iterations()
    assert all(f.done() for f in first) and not second.done()
    await asyncio.gather(*first)


async def test_a_failed_record_fails_the_futures_of_its_chunks_only() -> None:
    producer = FakeProducer()
    batcher = ReplyBatcher(producer)
    lost = [batcher.add("c1", chunk("r1", 0)), batcher.add("c1", chunk("r2", 0))]
    kept = batcher.add("c2", chunk("r3", 0))
    await next_iterations()
    producer.acks[0].set_exception(ConnectionError("broker gone"))
    producer.acks[1].set_result(None)
    for future in lost:
        with pytest.raises(ConnectionError, match="broker gone"):
            await future
    await kept


async def test_a_send_that_raises_fails_its_futures_and_the_next_record_still_goes() -> None:
    producer = FakeProducer()
    producer.error = ValueError("record too large")
    batcher = ReplyBatcher(producer)
    failed = batcher.add("c1", chunk("r1", 0))
    await next_iterations()
    with pytest.raises(ValueError, match="record too large"):
        await failed
    producer.error = None
    delivered = batcher.add("c1", chunk("r1", 1))
    await next_iterations()
    producer.ack_all()
    await delivered


async def test_a_record_holds_at_most_max_chunks() -> None:
    producer = FakeProducer()
    batcher = ReplyBatcher(producer, max_chunks=2)
    acks = [batcher.add("c1", chunk(f"r{n}", 0)) for n in range(5)]
    await next_iterations()
    assert [len(batch.chunks) for _, _, batch in producer.sent] == [2, 2, 1]
    assert [c.request_id for _, _, b in producer.sent for c in b.chunks] == [
        f"r{n}" for n in range(5)
    ]
    producer.ack_all()
    await asyncio.gather(*acks)


async def test_drain_hands_pending_chunks_to_the_producer_at_once() -> None:
    producer = FakeProducer()
    batcher = ReplyBatcher(producer)
    batcher.add("c1", chunk("r1", 0))
    await batcher.drain()
    assert producer.layout() == [("c1", b"t", [("r1", 0)])]
    await next_iterations()
    assert len(producer.sent) == 1  # the scheduled flush finds nothing left


async def test_a_record_carries_its_send_instant_and_its_chunks_futures_resolve_to_it() -> None:
    producer = FakeProducer()
    batcher = ReplyBatcher(producer)
    before = time.time_ns()
    first, second = batcher.add("c1", chunk("r1", 0)), batcher.add("c1", chunk("r2", 0))
    await next_iterations()
    producer.ack_all()
    await next_iterations()
    (headers,) = producer.headers
    sent_ns = path_ns(headers)
    assert sent_ns is not None and before <= sent_ns <= time.time_ns()
    assert first.result() == second.result() == sent_ns  # where the bridge's hop starts
