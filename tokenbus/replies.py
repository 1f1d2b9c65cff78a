"""Reads back what a request's reply topic holds: for failover (``stream_jobs.recovery``),
and for a client whose stream has gone quiet (``producers.client``).

# reads waiting for the consumer --> one Scan per reply topic (start, stop, who wants what)
# reply topic --> records keyed by a wanted tenant --> TokenChunkBatch (tokenbus.chunks)
# --> Scan.add --> each read's request's chunks, in the topic's order

A thin I/O shell: one consumer with no group, assigned and positioned per scan, so it
commits nothing and disturbs no client. Reads of one reply topic that wait for the
consumer together are answered by one scan of it: a lost worker makes the dispatcher read
back every request it held at once, and a batch's lines (or one bridge's requests) share
a reply topic, so N such reads cost one scan instead of N, each of which ends on the
caught-up wait below. A scan starts at the first record written at or after the earliest
of its reads' requests was created (minus a margin for clock skew) and goes on until it
has caught up: the broker has nothing more, or the records are newer than the scan (plus
the margin). Each read gets the chunks of its own tenant's request from the records of
its own window, the one a read of its own would have had (written since its request
was created, minus the margin, and before the scan began, plus the margin), so an
earlier request that used the same id on the topic is not mistaken for it. The worker
was lost seconds before, so all it wrote is behind that point. (End offsets are not used:
tansu 0.6.0 reports the last batch's base offset + 1, short of the end whenever that
batch holds several records.) If a scan fails, every read it was answering raises its
error; a read whose scan was cancelled under it (its leader's caller went away) is
scanned for again.

Caught up means a fetch wait of ``CAUGHT_UP_WAIT_MS`` brought nothing. It stays at
500 ms: on tansu a fetch behind the end can come back empty (a parked fetch answered
late, a stall before ``tokenbus.tansu.fetch_wait`` lengthens the wait, a gap being
refetched), and a scan cut short there resends a request from an earlier ``seq``: its
new tokens would follow the ones the client already holds under the same seqs. On
Apache Kafka the broker parks a fetch at the end for ``fetch_max_wait_ms`` (500 ms in
the ``kafka`` profile) before it answers empty, so a shorter wait there gains nothing.
Since reads now share scans, the wait is paid once per reply topic, not per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas import SchemaError
from tokenbus.chunks import Chunk, ChunkBatch, decode_batch
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.topics import reply_batch_key

CLOCK_SKEW = timedelta(seconds=5)
MAX_READ_S = 30.0
CAUGHT_UP_WAIT_MS = 500


@dataclass(frozen=True, eq=False)
class Wanted:
    """One ``read()``: a request's chunks on a reply topic, written since ``since_ms``
    (record timestamps, ms; the margin for clock skew already taken off). Compared by
    identity: two reads of the same request are two readers."""

    reply_to: str
    tenant_id: str
    request_id: str
    since_ms: int


class Scan:
    """One pass over a reply topic for several reads of it: where it starts, where it
    stops, and which chunks each read gets. Pure."""

    def __init__(self, reads: Sequence[Wanted], stop_ms: int) -> None:
        """``reads``: all of one reply topic; ``stop_ms``: records from then on are
        newer than the scan (its start, plus the margin)."""
        self.start_ms = min(read.since_ms for read in reads)
        self.stop_ms = stop_ms
        self.keys = frozenset(reply_batch_key(read.tenant_id) for read in reads)
        """Record keys worth decoding: a wanted tenant's."""
        self._readers: dict[tuple[str, str], list[Wanted]] = {}
        self._chunks: dict[Wanted, list[Chunk]] = {}
        for read in reads:
            self._readers.setdefault((read.tenant_id, read.request_id), []).append(read)
            self._chunks[read] = []

    def add(self, timestamp_ms: int, key: bytes | None, batch: ChunkBatch) -> None:
        """A record of the topic, in the topic's order: its chunks go to the reads of
        their request whose window holds the record."""
        if key != reply_batch_key(batch.tenant_id) or timestamp_ms >= self.stop_ms:
            return  # keyed for another tenant than its own; or newer than the scan
        for chunk in batch.chunks:
            for read in self._readers.get((batch.tenant_id, chunk.request_id), ()):
                if timestamp_ms >= read.since_ms:
                    self._chunks[read].append(chunk)

    def chunks(self, read: Wanted) -> list[Chunk]:
        return self._chunks[read]


def waiting_on(pending: dict[Wanted, asyncio.Future[list[Chunk]]], reply_to: str) -> list[Wanted]:
    """The reads of ``reply_to`` still unanswered, in the order they came. Pure."""
    return [w for w, answer in pending.items() if w.reply_to == reply_to and not answer.done()]


class KafkaReplyLog:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self._pending: dict[Wanted, asyncio.Future[list[Chunk]]] = {}

    async def read(
        self, *, reply_to: str, tenant_id: str, request_id: str, since: datetime
    ) -> list[Chunk]:
        """The chunks of ``tenant_id``'s ``request_id`` on ``reply_to``, written since
        ``since`` (the request's creation or admission); maybe found by another read's
        scan of the same topic."""
        since_ms = int((since - CLOCK_SKEW).timestamp() * 1000)
        wanted = Wanted(reply_to, tenant_id, request_id, since_ms)
        answer: asyncio.Future[list[Chunk]] = asyncio.get_running_loop().create_future()
        self._pending[wanted] = answer
        try:
            async with self._lock:  # one consumer, positioned for one scan at a time
                if not answer.done():  # else an earlier scan of the topic answered it
                    await self._scan(reply_to)
            return answer.result()
        finally:
            del self._pending[wanted]

    async def _scan(self, reply_to: str) -> None:
        """Answers every read of ``reply_to`` waiting now, this one among them."""
        consumer = await self._started()
        await consumer.topics()  # refreshes metadata: the reply topic may be new
        # Taken after that round trip: reads made meanwhile (the rest of a lost
        # worker's requests) join this scan rather than wait for the next.
        reads = waiting_on(self._pending, reply_to)
        answers = [self._pending[read] for read in reads]
        try:
            stop_ms = int((time.time() + CLOCK_SKEW.total_seconds()) * 1000)
            scan = Scan(reads, stop_ms)
            await self._read_topic(consumer, reply_to, scan)
        except Exception as error:
            for read, answer in zip(reads, answers, strict=True):
                if read in self._pending:  # else its caller went away
                    answer.set_exception(error)
            return
        for read, answer in zip(reads, answers, strict=True):
            if read in self._pending:
                answer.set_result(scan.chunks(read))

    async def _read_topic(self, consumer: AIOKafkaConsumer, reply_to: str, scan: Scan) -> None:
        partitions = consumer.partitions_for_topic(reply_to) or {0}
        tps = [TopicPartition(reply_to, p) for p in sorted(partitions)]
        consumer.assign(tps)
        starts = await consumer.offsets_for_times({tp: scan.start_ms for tp in tps})
        for tp in tps:
            start = starts.get(tp)
            if start is None:
                continue  # nothing written since the earliest request was created
            consumer.seek(tp, start.offset)
            await self._read_until(consumer, tp, scan)

    async def _read_until(self, consumer: AIOKafkaConsumer, tp: TopicPartition, scan: Scan) -> None:
        deadline = time.monotonic() + MAX_READ_S
        while time.monotonic() < deadline:
            batches = await consumer.getmany(tp, timeout_ms=CAUGHT_UP_WAIT_MS)
            if not batches:
                return  # caught up: the broker has nothing more
            for record in batches.get(tp, []):
                if record.timestamp >= scan.stop_ms:
                    return  # newer than the scan: the lost worker wrote none of it
                if record.key not in scan.keys:
                    continue  # no wanted tenant's batch
                try:
                    batch = decode_batch(record.value)
                except SchemaError:
                    continue  # not a batch of ours; the client dead-letters it
                scan.add(record.timestamp, record.key, batch)
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
