"""Reads back what a request's reply topic holds: for failover (``stream_jobs.recovery``),
and for a client whose stream has gone quiet (``producers.client``).

# reply topic --> records keyed by the request's tenant --> TokenChunkBatch (tokenbus.chunks)
# --> the chunks of the request, in the topic's order

A thin I/O shell: one consumer with no group, assigned and positioned per read, so it
commits nothing and disturbs no client. A read starts at the first record written at
or after the request was created (minus a margin for clock skew) and goes on until it
has caught up: the broker has nothing more, or the records are newer than the read
(plus the margin). The worker was lost seconds before, so all it wrote is behind that
point. (End offsets are not used: tansu 0.6.0 reports the last batch's base offset + 1,
short of the end whenever that batch holds several records.)
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas import SchemaError
from tokenbus.chunks import Chunk, decode_batch
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.topics import reply_batch_key

CLOCK_SKEW = timedelta(seconds=5)
MAX_READ_S = 30.0


class KafkaReplyLog:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()

    async def read(
        self, *, reply_to: str, tenant_id: str, request_id: str, since: datetime
    ) -> list[Chunk]:
        """The chunks of ``tenant_id``'s ``request_id`` on ``reply_to``, written since
        ``since`` (the request's creation or admission)."""
        async with self._lock:  # one consumer, positioned for one read at a time
            consumer = await self._started()
            await consumer.topics()  # refreshes metadata: the reply topic may be new
            partitions = consumer.partitions_for_topic(reply_to) or {0}
            tps = [TopicPartition(reply_to, p) for p in sorted(partitions)]
            consumer.assign(tps)
            since_ms = int((since - CLOCK_SKEW).timestamp() * 1000)
            until_ms = int((time.time() + CLOCK_SKEW.total_seconds()) * 1000)
            starts = await consumer.offsets_for_times({tp: since_ms for tp in tps})
            chunks: list[Chunk] = []
            for tp in tps:
                start = starts.get(tp)
                if start is None:
                    continue  # nothing written since the request was created
                consumer.seek(tp, start.offset)
                chunks += await self._read_until(consumer, tp, until_ms, tenant_id, request_id)
            return chunks

    async def _read_until(
        self,
        consumer: AIOKafkaConsumer,
        tp: TopicPartition,
        until_ms: int,
        tenant_id: str,
        request_id: str,
    ) -> list[Chunk]:
        key = reply_batch_key(tenant_id)
        chunks: list[Chunk] = []
        deadline = time.monotonic() + MAX_READ_S
        while time.monotonic() < deadline:
            batches = await consumer.getmany(tp, timeout_ms=500)
            if not batches:
                return chunks  # caught up: the broker has nothing more
            for record in batches.get(tp, []):
                if record.timestamp >= until_ms:
                    return chunks  # newer than the read: the lost worker wrote none of it
                if record.key != key:
                    continue  # another tenant's batch
                try:
                    batch = decode_batch(record.value)
                except SchemaError:
                    continue  # not a batch of ours; the client dead-letters it
                if batch.tenant_id == tenant_id:
                    chunks += (c for c in batch.chunks if c.request_id == request_id)
        raise TimeoutError(f"reading {tp.topic} took over {MAX_READ_S:.0f} s")

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            self._consumer = make_consumer(self._settings, group_id=None)
            await self._consumer.start()
        return self._consumer

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
