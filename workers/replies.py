"""One reply record per engine step per (reply topic, tenant), instead of one per token.

# TokenChunk --> the group of its (reply topic, tenant) for this loop iteration
# next loop iteration --> one TokenChunkBatch record per group (at most max_chunks each)
# the record's acknowledgement --> the future ``add`` returned for each of its chunks

Why one loop iteration: vLLM's output handler wakes the ``generate()`` streams of all
requests of one engine step together, so they all run (and add their chunks) in the
same iteration; the flush scheduled with ``call_soon`` by the first ``add`` runs in the
next one, after them, and adds no wait. (The handler yields between slices of
``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` requests, so a very large step may take a few records.)

Order: records go to the producer one at a time, in the order of their flushes, and a
record holds its chunks in the order they were added. One request's chunks thus reach
its topic in ``seq`` order, which the client's gap rule relies on.

Delivery: a chunk's future resolves when the broker acknowledged the record carrying
it, and fails with the send's error otherwise, so the worker can report usage only
after delivery, as with one record per chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas import TokenChunk, TokenChunkBatch, encode
from tokenbus.topics import reply_batch_key

log = logging.getLogger(__name__)

MAX_CHUNKS_PER_RECORD = 256
"""Keeps a record bounded (well under the producer's 1 MB ``max_request_size``)."""


class Producer(Protocol):
    """The part of ``AIOKafkaProducer`` the batcher uses."""

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[Any]:
        """Queues one record; the returned future resolves when the broker acks it."""


@dataclass
class _Record:
    topic: str
    tenant_id: str
    chunks: list[TokenChunk] = field(default_factory=list)
    acks: list[asyncio.Future[None]] = field(default_factory=list)

    def settle(self, sent: asyncio.Future[Any]) -> None:
        if log.isEnabledFor(logging.DEBUG) and not sent.cancelled() and not sent.exception():
            log.debug(
                "%s offset %d: %s",
                self.topic,
                sent.result().offset,
                " ".join(f"{c.request_id}#{c.seq}" for c in self.chunks),
            )
        for ack in self.acks:
            if ack.done():
                continue  # its waiter was cancelled
            if sent.cancelled():
                ack.cancel()
            elif (exc := sent.exception()) is not None:
                ack.set_exception(exc)
            else:
                ack.set_result(None)

    def fail(self, exc: BaseException) -> None:
        for ack in self.acks:
            if ack.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                ack.cancel()
            else:
                ack.set_exception(exc)


class ReplyBatcher:
    """Collects the chunks of one loop iteration; sends one record per group."""

    def __init__(self, producer: Producer, *, max_chunks: int = MAX_CHUNKS_PER_RECORD) -> None:
        self._producer = producer
        self._max_chunks = max_chunks
        self._pending: dict[tuple[str, str], list[_Record]] = {}
        self._flush_scheduled = False
        self._outbox: deque[_Record] = deque()
        self._sender: asyncio.Task[None] | None = None

    def add(self, topic: str, chunk: TokenChunk) -> asyncio.Future[None]:
        """Queues ``chunk`` for ``topic``; the future resolves once it was delivered."""
        loop = asyncio.get_running_loop()
        records = self._pending.setdefault((topic, chunk.tenant_id), [])
        if not records or len(records[-1].chunks) >= self._max_chunks:
            records.append(_Record(topic, chunk.tenant_id))
        ack: asyncio.Future[None] = loop.create_future()
        records[-1].chunks.append(chunk)
        records[-1].acks.append(ack)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return ack

    async def drain(self) -> None:
        """Hands everything added so far to the producer; call before stopping it."""
        self._flush()
        if self._sender is not None:
            await asyncio.wait([self._sender])

    def _flush(self) -> None:
        self._flush_scheduled = False
        for records in self._pending.values():
            self._outbox.extend(records)
        self._pending.clear()
        if self._outbox and (self._sender is None or self._sender.done()):
            self._sender = asyncio.get_running_loop().create_task(self._send_outbox())

    async def _send_outbox(self) -> None:
        # One sender, one record at a time: a send may wait (metadata, a full batch),
        # and no later record may overtake it.
        while self._outbox:
            record = self._outbox.popleft()
            try:
                batch = TokenChunkBatch(tenant_id=record.tenant_id, chunks=record.chunks)
                sent = await self._producer.send(
                    record.topic, encode(batch), key=reply_batch_key(record.tenant_id)
                )
            except Exception as exc:
                record.fail(exc)
            except BaseException as exc:  # cancelled: the waiters must not hang
                record.fail(exc)
                raise
            else:
                sent.add_done_callback(record.settle)
