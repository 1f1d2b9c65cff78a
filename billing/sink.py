"""The billing sink: the usage topic --> the UsageStore, one batch at a time.

When it commits, and why that loses nothing
-------------------------------------------
For each batch (up to ``billing_batch_rows`` records, or what arrived within
``billing_batch_interval_s`` of the first one), in this order:

1. decode every record; one that does not decode, or cannot be a row, goes to the
   dead-letter topic, and the sink awaits the broker's ack;
2. insert the decoded events, retrying with backoff until the store accepts them;
3. only then commit the offsets just past the batch.

Offsets are committed only for records already in the store or the dead-letter topic.
A crash before step 3 redelivers the batch from the last commit. The redelivered rows
carry the same (tenant_id, session_id, request_id, attempt) key as the first copies,
so the ReplacingMergeTree collapses them and FINAL reads count each attempt once. A bad
record may reach the dead-letter topic twice; that topic is read by people, not summed.

While an insert fails, the sink neither commits nor fetches, so it holds one batch at
most. If the outage outlasts the consumer's ``max_poll_interval_ms``, the group moves
its partitions elsewhere; the commit that follows then fails (logged) and the new owner
redelivers from the last commit, which the sort key again collapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiokafka.errors import KafkaError

from billing.retry import Backoff
from billing.rows import UnstorableEvent, usage_row
from billing.storage import UsageStore
from schemas import SchemaError, UsageEvent, decode
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter
from tokenbus.kafka import Publish, make_consumer, make_producer, publisher
from tokenbus.topics import Topics

log = logging.getLogger(__name__)


def billing_group_id(settings: Settings) -> str:
    """``tokenbus-billing`` by default; stacks sharing a broker under other topic
    prefixes get groups of their own instead of rebalancing each other."""
    return f"{settings.topic_prefix}-billing"


# The sink polls at least this often while idle, so that `stop` is noticed promptly
# even with a batch interval of zero.
_MIN_IDLE_POLL_S = 0.05

Batch = dict[Any, list[Any]]
"""TopicPartition -> its ConsumerRecords, in offset order (aiokafka's getmany shape)."""


class UsageConsumer(Protocol):
    """The part of AIOKafkaConsumer the sink uses; tests pass a fake."""

    async def getmany(
        self, *partitions: Any, timeout_ms: int = 0, max_records: int | None = None
    ) -> Batch: ...

    async def commit(self, offsets: dict[Any, int] | None = None) -> None: ...

    def assignment(self) -> set[Any]: ...


class BillingSink:
    def __init__(
        self,
        settings: Settings,
        store: UsageStore,
        *,
        backoff: Backoff | None = None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._topics = Topics(settings.topic_prefix)
        self.group_id = billing_group_id(settings)
        self._backoff = backoff or Backoff()
        self._batch_rows = max(1, settings.billing_batch_rows)
        self._batch_interval_s = max(0.0, settings.billing_batch_interval_s)
        self.num_batches = 0
        self.num_inserted = 0
        """Rows handed to the store, redelivered duplicates included."""
        self.num_dead_letters = 0
        self.num_write_failures = 0
        """Failed store inserts and dead-letter sends; each one is retried."""
        self.num_commit_failures = 0

    def stats(self) -> dict[str, int]:
        return {
            "num_batches": self.num_batches,
            "num_inserted": self.num_inserted,
            "num_dead_letters": self.num_dead_letters,
            "num_write_failures": self.num_write_failures,
            "num_commit_failures": self.num_commit_failures,
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Consumes until ``stop`` is set, then flushes the batch in hand and returns."""
        consumer = make_consumer(self._settings, self._topics.usage, group_id=self.group_id)
        producer = make_producer(self._settings)
        await producer.start()
        try:
            await consumer.start()
            try:
                log.info("billing sink consuming %s as %s", self._topics.usage, self.group_id)
                await self.consume(consumer, publisher(producer), stop)
            finally:
                await consumer.stop()
        finally:
            await producer.stop()
            log.info("billing sink stopped: %s", self.stats())

    async def consume(self, consumer: UsageConsumer, publish: Publish, stop: asyncio.Event) -> None:
        """The loop of ``run``, on clients the caller started and will stop."""
        while not stop.is_set():
            batch = await self._next_batch(consumer, stop)
            if batch:
                await self._handle(batch, consumer, publish, stop)

    # Fetches --> one batch: up to batch_rows records, or the interval's worth.
    async def _next_batch(self, consumer: UsageConsumer, stop: asyncio.Event) -> Batch:
        loop = asyncio.get_running_loop()
        batch: Batch = {}
        num_records = 0
        deadline: float | None = None
        while num_records < self._batch_rows and not stop.is_set():
            if deadline is None:
                wait_s = max(self._batch_interval_s, _MIN_IDLE_POLL_S)
            else:
                wait_s = deadline - loop.time()
                if wait_s <= 0:
                    break
            fetched = await consumer.getmany(
                timeout_ms=int(wait_s * 1000), max_records=self._batch_rows - num_records
            )
            for tp, records in fetched.items():
                if records:
                    batch.setdefault(tp, []).extend(records)
                    num_records += len(records)
            if num_records and deadline is None:
                deadline = loop.time() + self._batch_interval_s
        return batch

    # Batch --> dead letters + store insert --> offset commit.
    async def _handle(
        self, batch: Batch, consumer: UsageConsumer, publish: Publish, stop: asyncio.Event
    ) -> None:
        events: list[UsageEvent] = []
        for records in batch.values():
            for record in records:
                try:
                    event = decode(UsageEvent, record.value)
                    usage_row(event)  # fails here, not in the insert, for a poison event
                except (SchemaError, UnstorableEvent) as exc:
                    if not await self._dead_letter(publish, record, str(exc), stop):
                        return
                else:
                    events.append(event)
        if events:
            if not await self._insert(events, stop):
                return  # stopping mid-outage: uncommitted, so the batch is redelivered
            self.num_inserted += len(events)
        self.num_batches += 1
        await self._commit(consumer, {tp: records[-1].offset + 1 for tp, records in batch.items()})

    async def _insert(self, events: list[UsageEvent], stop: asyncio.Event) -> bool:
        async def insert() -> None:
            await asyncio.to_thread(self._store.insert_usage, events)

        return await self._until_done(insert, stop, f"insert of {len(events)} usage rows")

    async def _dead_letter(
        self, publish: Publish, record: Any, reason: str, stop: asyncio.Event
    ) -> bool:
        async def send() -> None:
            await dead_letter(
                publish,
                self._topics,
                consumer=self.group_id,
                source_topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                key=record.key,
                value=record.value,
                reason=reason,
            )

        sent = await self._until_done(send, stop, f"dead letter of offset {record.offset}")
        if sent:
            self.num_dead_letters += 1
        return sent

    async def _until_done(
        self, attempt: Callable[[], Awaitable[None]], stop: asyncio.Event, what: str
    ) -> bool:
        """Retries ``attempt`` with backoff; False if ``stop`` was set while waiting."""
        num_failures = 0
        while True:
            try:
                await attempt()
                return True
            except Exception as exc:
                num_failures += 1
                self.num_write_failures += 1
                delay_s = self._backoff.delay_s(num_failures)
                log.warning(
                    "%s failed (%d in a row), retrying in %.1f s: %s",
                    what,
                    num_failures,
                    delay_s,
                    exc,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay_s)
            if stop.is_set():
                log.warning("stopping with %s undone; it will be redelivered", what)
                return False

    async def _commit(self, consumer: UsageConsumer, offsets: dict[Any, int]) -> None:
        # After a rebalance some partitions may be someone else's; their new owner
        # redelivers from the last commit, and we must not move its offsets.
        assigned = consumer.assignment()
        owned = {tp: offset for tp, offset in offsets.items() if tp in assigned}
        try:
            if owned:
                await consumer.commit(owned)
        except KafkaError as exc:
            self.num_commit_failures += 1
            log.warning("offset commit failed; the batch will be redelivered: %s", exc)
