"""The job's tables write their changelog records straight to aiokafka, in order.

# table write (Faust's __setitem__/__delitem__, or TableLedger's put_at) --> send_changelog
#   Faust 0.15.3: FutureMessage + PendingMessage, codecs, ProducerBuffer queue, its pump,
#                 Topic.publish_message, _on_published, sensors  (~59 µs of CPU a record)
#   here:         one queue of (topic, partition, key, value) --> one pump --> aiokafka's
#                 send (~4 µs a record, as a plain aiokafka producer's keyed record)

Why: a request's FORWARDED ledger entry is one changelog record (its DONE entry another),
and Faust's path for it was the largest single cost of admission left in Faust
(``bench.faust_floor``: Faust's floor for a forward and a table write was 110 µs of CPU
per request that way, 66 this way; BENCHMARKS.md).

What stays as Faust has it: the table's store (written here, as ``Table.__setitem__``
writes it), the changelog topic and its partition (the event's, or the one named), the
bytes (the job's tables are raw bytes both ways), recovery and standbys (Faust reads the
changelog back as it wrote it), and the record's future (resolved with the broker's
acknowledgement, for ``TableLedger.put_durably``). Order is kept: every record of every
table goes through one queue and one pump, which hands each to aiokafka's accumulator
before the next (aiokafka keeps a partition's records in the order they were appended).

Where it commits: Faust flushes its producer before it commits a source offset
(``Consumer.commit`` awaits ``app.producer.flush()``); from the first record sent here,
that flush waits for this queue first, so no event is committed before the records
written under it are held by the broker, exactly as with Faust's own buffer. Anything
this path cannot take (a non-bytes key or value, a serializer other than raw, a
transaction, another driver, a producer not running) goes Faust's own way; none of the
job's writes is such, so its records never take both ways at once.

The queue has no bound of its own, as Faust's buffer has (its consumer waits for the
buffer to ebb): every record here is written under an event the job holds (at most
``admit_concurrency`` requests at a time) or a usage event it fetched, and a broker that
stops taking records stops the forwards those wait on, and the fetches, with them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from functools import partial
from typing import Any

import faust
from aiokafka.structs import RecordMetadata
from faust.stores.memory import Store as MemoryStore
from faust.tables.table import Table

log = logging.getLogger(__name__)

RAW = (None, "raw")


class DirectChangelog:
    """One app's queue of changelog records, drained in order into aiokafka."""

    def __init__(self, app: faust.App) -> None:
        self._app = app
        self._queue: deque[tuple[str, int, bytes, bytes | None, asyncio.Future[Any]]] = deque()
        self._pump: asyncio.Task[None] | None = None
        self._installed = False
        self.num_sent = 0
        self.num_failed = 0

    def _install(self) -> None:
        # The app's producer flush (before every commit, rebalance and stop) waits for
        # this queue too. Done at the first record, in the running loop: the producer
        # made earlier would bind the app to a loop too soon.
        self._installed = True
        producer = self._app.producer
        flush = producer.flush

        async def flush_all() -> None:
            await self.flush()
            await flush()

        producer.flush = flush_all  # type: ignore[method-assign]

    def available(self) -> bool:
        """Whether records can go this way now: the aiokafka driver's producer is
        running, outside a transaction."""
        producer = self._app.producer
        return getattr(producer, "_producer", None) is not None and not self._app.in_transaction

    def send(
        self, topic: str, partition: int, key: bytes, value: bytes | None
    ) -> asyncio.Future[Any]:
        """Queues one record; its future has the broker's acknowledgement
        (``RecordMetadata``), or the error that kept it from the broker."""
        if not self._installed:
            self._install()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((topic, partition, key, value, future))
        if self._pump is None:
            self._pump = asyncio.create_task(self._drain())
        return future

    async def flush(self) -> None:
        """Returns once every record queued so far is in aiokafka's hands."""
        while (pump := self._pump) is not None:
            await asyncio.wait({pump})  # not the pump's own end, whatever it was

    async def _drain(self) -> None:
        # The record stays at the head of the queue until aiokafka has it: a flush that
        # comes meanwhile waits for it.
        queue = self._queue
        try:
            producer = self._app.producer._ensure_producer()  # type: ignore[attr-defined]
            while queue:
                topic, partition, key, value, future = queue[0]
                try:
                    sent = await producer.send(topic, value, key=key, partition=partition)
                except Exception as exc:
                    queue.popleft()
                    self._failed(future, topic, partition, exc)
                    continue
                queue.popleft()
                sent.add_done_callback(partial(self._settle, future, topic, partition))
        except BaseException as exc:
            # Stopped (or the producer is gone): what is left never reached aiokafka.
            while queue:
                topic, partition, _, _, future = queue.popleft()
                self._failed(future, topic, partition, exc)
            raise
        finally:
            self._pump = None

    def _settle(
        self, future: asyncio.Future[Any], topic: str, partition: int, sent: asyncio.Future[Any]
    ) -> None:
        if sent.cancelled():
            self._failed(future, topic, partition, asyncio.CancelledError())
        elif (exc := sent.exception()) is not None:
            self._failed(future, topic, partition, exc)
        else:
            self.num_sent += 1
            if not future.done():
                future.set_result(sent.result())

    def _failed(
        self, future: asyncio.Future[Any], topic: str, partition: int, exc: BaseException
    ) -> None:
        self.num_failed += 1
        log.error(
            "a changelog record for %s[%d] did not reach the broker: %r", topic, partition, exc
        )
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        elif not future.done():
            future.set_exception(exc)
            # Retrieved: a write nobody awaits (put_at's) must not warn when collected.
            future.exception()


class DirectChangelogTable(Table[bytes, bytes]):
    """A Faust table whose changelog records go through ``DirectChangelog``."""

    def __init__(self, app: faust.App, *, changelog: DirectChangelog, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._direct = changelog

    def send_changelog(
        self,
        partition: int | None,
        key: Any,
        value: Any,
        key_serializer: Any = None,
        value_serializer: Any = None,
    ) -> Any:
        if (
            partition is None
            or not isinstance(key, bytes)
            or not (value is None or isinstance(value, bytes))
            or (key_serializer or self.key_serializer) not in RAW
            or (value_serializer or self.value_serializer) not in RAW
            or not self._direct.available()
        ):
            return super().send_changelog(partition, key, value, key_serializer, value_serializer)
        future = self._direct.send(self.changelog_topic.get_topic_name(), partition, key, value)
        if not isinstance(self.data, MemoryStore):
            future.add_done_callback(self._persisted)
        return future

    # Faust's Table.on_key_set and on_key_del (its __setitem__ and __delitem__), which
    # read the partition back from Faust's FutureMessage: here it is the one named.
    def on_key_set(self, key: Any, value: Any) -> None:
        partition = self.partition_for_key(key)
        sent = self.send_changelog(partition, key, value)
        partition = _partition_of(sent, partition)
        self._maybe_set_key_ttl(key, partition)
        self._sensor_on_set(self, key, value)

    def on_key_del(self, key: Any) -> None:
        partition = self.partition_for_key(key)
        sent = self.send_changelog(partition, key, value=None, value_serializer="raw")
        partition = _partition_of(sent, partition)
        self._maybe_del_key_ttl(key, partition)
        self._sensor_on_del(self, key)

    def _persisted(self, future: asyncio.Future[Any]) -> None:
        # Faust's _on_changelog_sent: a store that persists keeps the offset it holds.
        if not future.cancelled() and future.exception() is None:
            sent: RecordMetadata = future.result()
            self.data.set_persisted_offset(sent.topic_partition, sent.offset)


def _partition_of(sent: Any, partition: int | None) -> int:
    """The partition a record went to: the one named, or (Faust's path, its partitioner)
    the one its FutureMessage holds."""
    if partition is None:
        partition = sent.message.partition
    assert partition is not None
    return partition


def direct_table(
    app: faust.App, changelog: DirectChangelog, name: str, partitions: int
) -> DirectChangelogTable:
    """``app.Table(name, default=None, key_type=bytes, value_type=bytes, partitions=...)``
    as a ``DirectChangelogTable``."""
    table = DirectChangelogTable(
        app,
        changelog=changelog,
        name=name,
        default=None,
        beacon=app.tables.beacon,
        key_type=bytes,
        value_type=bytes,
        partitions=partitions,
    )
    app.tables.add(table)
    return table
