"""One reply record per engine step per (reply topic, tenant), instead of one per token.

# Chunk --> the group of its (reply topic, tenant) for this loop iteration
# next loop iteration --> one TokenChunkBatch record per group (at most max_chunks each),
#   encoded by tokenbus.chunks
# the record's acknowledgement --> the one future ``add`` returned for each of its chunks,
#   resolved to the instant the record was handed to the producer (its ``tokenbus-path-ns``
#   header: where the path to a first token carried by it stands, ``tokenbus.span_path``)

Why one loop iteration: vLLM's output handler wakes the ``generate()`` streams of all
requests of one engine step together, so they all run (and add their chunks) in the
same iteration; the flush scheduled with ``call_soon`` by the first ``add`` runs in the
next one, after them, and adds no wait. (The handler yields between slices of
``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` requests, so a very large step may take a few records.)

Order: a topic's records go to the producer one at a time, in the order of their
flushes, and a record holds its chunks in the order they were added. One request's
chunks thus reach its topic in ``seq`` order, which the client's gap rule relies on.
Each topic has a sender of its own: a send may wait (for the metadata of a topic that is
gone, on a broker that does not make topics on demand, up to the producer's request
timeout), and one topic's wait must not hold up the replies of every other tenant.

Delivery: a chunk's future resolves when the broker acknowledged the record carrying
it, and fails with the send's error otherwise, so the worker can report usage only
after delivery, as with one record per chunk. The chunks of one record share one future
(a future per chunk was a tenth of the worker's CPU), and ``Deliveries`` keeps only the
futures of one request still in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenbus.chunks import Chunk, encode_batch
from tokenbus.span_path import path_header
from tokenbus.topics import reply_batch_key

log = logging.getLogger(__name__)

MAX_CHUNKS_PER_RECORD = 256
"""Keeps a record bounded (well under the producer's 1 MB ``max_request_size``)."""


class Producer(Protocol):
    """The part of ``AIOKafkaProducer`` the batcher uses."""

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        """Queues one record; the returned future resolves when the broker acks it."""


@dataclass
class _Record:
    topic: str
    tenant_id: str
    delivered: asyncio.Future[int]
    chunks: list[Chunk] = field(default_factory=list)
    sent_ns: int = 0

    def settle(self, sent: asyncio.Future[Any]) -> None:
        if log.isEnabledFor(logging.DEBUG) and not sent.cancelled() and not sent.exception():
            log.debug(
                "%s offset %d: %s",
                self.topic,
                sent.result().offset,
                " ".join(f"{c.request_id}#{c.seq}" for c in self.chunks),
            )
        if sent.cancelled():
            self.fail(asyncio.CancelledError())
        elif (exc := sent.exception()) is not None:
            self.fail(exc)
        elif not self.delivered.done():
            self.delivered.set_result(self.sent_ns)

    def fail(self, exc: BaseException) -> None:
        if self.delivered.done():
            return
        if isinstance(exc, asyncio.CancelledError):
            self.delivered.cancel()
        else:
            self.delivered.set_exception(exc)


class ReplyBatcher:
    """Collects the chunks of one loop iteration; sends one record per group."""

    def __init__(self, producer: Producer, *, max_chunks: int = MAX_CHUNKS_PER_RECORD) -> None:
        self._producer = producer
        self._max_chunks = max_chunks
        self._pending: dict[tuple[str, str], _Record] = {}
        self._flush_scheduled = False
        self._full: list[_Record] = []
        """Records that filled up before the flush, in order: they go before the rest."""
        self._outboxes: dict[str, deque[_Record]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}

    def add(self, topic: str, chunk: Chunk) -> asyncio.Future[int]:
        """Queues ``chunk`` for ``topic``; the future resolves once it was delivered
        (it is the future of every chunk in the same record), to the wall-clock ns at
        which the record went to the producer."""
        group = (topic, chunk.tenant_id)
        record = self._pending.get(group)
        if record is None or len(record.chunks) >= self._max_chunks:
            if record is not None:
                self._full.append(record)  # goes first: the order is kept
            loop = asyncio.get_running_loop()
            record = self._pending[group] = _Record(topic, chunk.tenant_id, loop.create_future())
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
        record.chunks.append(chunk)
        return record.delivered

    async def drain(self) -> None:
        """Hands everything added so far to the producer; call before stopping it."""
        self._flush()
        while self._senders:
            await asyncio.wait(list(self._senders.values()))

    def _flush(self) -> None:
        self._flush_scheduled = False
        records = [*self._full, *self._pending.values()]
        self._full.clear()
        self._pending.clear()
        for record in records:
            outbox = self._outboxes.get(record.topic)
            if outbox is None:
                outbox = self._outboxes[record.topic] = deque()
            outbox.append(record)
            if record.topic not in self._senders:
                sender = asyncio.get_running_loop().create_task(self._send_outbox(record.topic))
                self._senders[record.topic] = sender

    async def _send_outbox(self, topic: str) -> None:
        # One sender a topic, one record at a time: a send may wait (metadata, a full
        # batch), and no later record of its topic may overtake it.
        outbox = self._outboxes[topic]
        try:
            await self._send_all(outbox)
        finally:
            del self._outboxes[topic]
            del self._senders[topic]
            for record in outbox:  # cancelled: their waiters must not hang
                record.fail(asyncio.CancelledError())

    async def _send_all(self, outbox: deque[_Record]) -> None:
        while outbox:
            record = outbox.popleft()
            record.sent_ns = time.time_ns()
            try:
                sent = await self._producer.send(
                    record.topic,
                    encode_batch(record.tenant_id, record.chunks),
                    key=reply_batch_key(record.tenant_id),
                    headers=[path_header(record.sent_ns)],
                )
            except Exception as exc:
                record.fail(exc)
            except BaseException as exc:  # cancelled: the waiters must not hang
                record.fail(exc)
                raise
            else:
                sent.add_done_callback(record.settle)


class Deliveries:
    """The futures of one request's chunks still in flight: ``wait()`` returns once all
    were delivered, or raises the first failure. Delivered ones are let go as chunks
    are added, so a long stream holds a few futures, not one per step."""

    def __init__(self) -> None:
        self._futures: deque[asyncio.Future[int]] = deque()

    def track(self, delivered: asyncio.Future[int]) -> None:
        futures = self._futures
        if futures and futures[-1] is delivered:
            return  # the same record
        while futures and futures[0].done() and not futures[0].cancelled():
            if futures[0].exception() is not None:
                break  # kept, for wait() to raise
            futures.popleft()
        futures.append(delivered)

    async def wait(self) -> None:
        await asyncio.gather(*self._futures)
