"""The billing sink: the usage topic --> ClickHouse, one batch at a time, each attempt once.

Write order, and why it bills every attempt exactly once
--------------------------------------------------------
A batch closes at ``billing_batch_rows`` records (taking up to ``billing_batch_max_rows``
already fetched under a backlog) or ``billing_batch_interval_s`` after its first record,
whichever comes first, but not by time within ``billing_insert_gap_s`` of the previous
batch's close (``close_at``): a steady trickle is one insert every few seconds, not one
a second. For each batch, in this order:

1. decode every record (a partition's records in one call, ``decode_usages``, unless
   one of them needs the slow path); one that does not decode, or cannot be a row,
   goes to the dead-letter topic, and the sink awaits the broker's ack;
2. keep the first copy of each attempt (tenant, session, request, attempt) in the batch,
   and find which of those ClickHouse already holds: the index of recent attempts
   (``billing.recent``) clears most of them, and only the rest, the unsure ones, are
   looked up in ClickHouse (an indexed read); retried;
3. insert the rest, priced, as one block (built by column from the decoded events)
   whose ``insert_deduplication_token`` is a digest of its keys; retried with the same
   block and token until ClickHouse acknowledges. The rollups (aggregate projections)
   are written inside the same parts as the rows. Then the inserted attempts join the
   index;
4. only then commit the offsets just past the batch.

Deduplication choice: a ReplacingMergeTree whose rollups are correct without ``FINAL``.
``usage_events`` is keyed by the attempt, but nothing relies on merges or ``FINAL``:
step 2 keeps every copy that ClickHouse already holds out of the insert, so each attempt
is in one part, counted once by the table and by its rollups read plainly. A rollup
lives in the part it summarizes, so a kill at any instant leaves rows and rollups in
step (migration 002 says why not materialized views). Step 3's token makes the one
ambiguous case safe: an insert that landed although its acknowledgement was lost is
repeated with the same token, and ClickHouse drops the repeat.

Why the index may answer for ClickHouse: it holds a hash of every attempt ClickHouse
stores for this sink's partitions that was created at or after its horizon, so an
attempt created since then whose hash it lacks is not stored. It is read back from
ClickHouse (the attempts of the last ``billing_recent_window_s`` of ``created_at``)
before the first batch after each assignment, that is after every previous owner's
last insert (each member's revoke waits for its batch in hand, and every revoke comes
before any assignment); from then on only this sink writes these partitions' attempts
(copies of an attempt share its tenant, the records' key, so its partition), and it adds
each insert once acknowledged. Records a revoke took away while a batch was being
gathered are dropped, uncommitted, for their new owner. Anything created before the
horizon or less than ``billing_copy_skew_s`` after it (copies of one attempt run twice
were created that far apart at most), or whose hash it holds, is looked up as before.

Loses nothing: offsets are committed only for records already in ClickHouse or in the
dead-letter topic, so a crash anywhere before step 4 redelivers the batch, and step 2
finds what the crashed run had written: the restarted sink reads its index back from
ClickHouse, complete from its horizon, so each redelivered copy is either in it or older
than its horizon, and looked up either way. A replay of the whole topic (a reset or a
new group) is answered the same way: its copies are either in the index read back or
older than its horizon. A bad record may
reach the dead-letter topic twice; that topic is read by people, not summed.

Bounded: while ClickHouse is unreachable the sink retries with capped backoff, neither
commits nor fetches, so it holds one batch at most. The index holds at most
``billing_recent_attempts`` hashes: past that it forgets its oldest minutes and moves its
horizon, which keeps it complete. On a rebalance, revoking waits for
the batch in hand, so the next owner of a partition starts after this member's last
insert and commit (within the group's rebalance timeout). If an outage outlasts the
consumer's ``max_poll_interval_ms``, the group moves the partitions anyway; the commit
then fails (logged) and the new owner redelivers from the last commit, which step 2
again answers. The one case left to the table's ReplacingMergeTree is two members
inserting the same new attempt at the same moment, which needs a member the group has
already expelled to still be writing; ``FINAL`` reads of ``usage_events`` stay exact even
then, and plain reads and the rollups count that attempt twice until a merge of the two
parts collapses it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from operator import attrgetter
from typing import Any, Protocol

from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from opentelemetry.trace import SpanKind

from billing.dedup import ColumnPlan, Stored, any_resent, keyed_first_copies, plan_keyed_columns
from billing.recent import RecentAttempts
from billing.rows import UnstorableEvent, check_storable
from billing.storage import UsageStore
from billing.usage_codec import Usage, decode_usage, decode_usages
from schemas import SchemaError
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter_until_sent
from tokenbus.finished_span import end_span
from tokenbus.heap_reserve import reserve_heap
from tokenbus.kafka import Publish, make_consumer, make_producer, publisher
from tokenbus.pricing import Pricer
from tokenbus.retry import Backoff, until_done
from tokenbus.topics import Topics
from tokenbus.tracing import Tracing, extract, span_attributes

log = logging.getLogger(__name__)


def billing_group_id(settings: Settings) -> str:
    """``tokenbus-billing`` by default; stacks sharing a broker under other topic
    prefixes get groups of their own instead of rebalancing each other."""
    return f"{settings.topic_prefix}-billing"


def close_at(
    first_at: float, last_close_at: float | None, interval_s: float, gap_s: float
) -> float:
    """When a batch closes by time (its size may close it sooner): ``interval_s`` after
    its first record came, ``first_at``, and no sooner than ``gap_s`` after the previous
    batch closed, ``last_close_at`` (None: this is the first)."""
    if last_close_at is None:
        return first_at + interval_s
    return max(first_at + interval_s, last_close_at + gap_s)


# The sink polls at least this often while idle, so that `stop` is noticed promptly
# even with a batch interval of zero.
_MIN_IDLE_POLL_S = 0.05

_HEADERS = attrgetter("headers")
_CREATED_AT = attrgetter("created_at")
"""Read by C loops over a batch's records and events, without a Python step per one."""

Batch = dict[Any, list[Any]]
"""TopicPartition -> its ConsumerRecords, in offset order (aiokafka's getmany shape)."""


class UsageConsumer(Protocol):
    """The part of AIOKafkaConsumer the sink uses; tests pass a fake."""

    async def getmany(
        self, *partitions: Any, timeout_ms: int = 0, max_records: int | None = None
    ) -> Batch: ...

    async def commit(self, offsets: dict[Any, int] | None = None) -> None: ...

    def assignment(self) -> set[Any]: ...


class _CollectorPause:
    """Pauses the cycle collector from a batch's first record until the batch is gone.

    A batch allocates tens of thousands of small objects (the fetched records, then the
    decoded events, rows and columns) that form no cycles and go with their last
    reference; meanwhile each automatic collection would walk the batch gathered so far
    again (a third of the sink's CPU in ``python -m bench.billing_sink`` before any pause).
    The gathering counts as much as the handling: its records outlive many collections,
    and after ``gc.freeze()`` the full ones come often, each walking them. ``resume`` runs
    one full collection once the batch is freed, which finds any cycle made meanwhile;
    after ``gc.freeze()`` at start-up it walks little but the index of recent attempts.
    An idle sink, waiting for a first record, runs with the collector as it found it.
    """

    def __init__(self) -> None:
        self._paused = False
        self._was_enabled = False

    def pause(self) -> None:
        if not self._paused:
            self._paused = True
            self._was_enabled = gc.isenabled()
            gc.disable()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            if self._was_enabled:
                gc.enable()
                gc.collect()


class _FinishBatchBeforeRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    """Revoking waits for the batch in hand: its insert and commit finish first. The
    revoked partitions' records fetched meanwhile are dropped; an assignment makes the
    sink read its index of recent attempts back from ClickHouse."""

    def __init__(self, sink: BillingSink) -> None:
        self._sink = sink

    async def on_partitions_revoked(self, revoked: Any) -> None:
        async with self._sink._in_flight:
            self._sink._revoked.update(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        # Every member's revoke (so every insert of a previous owner) came first.
        self._sink._recent = None


class BillingSink:
    def __init__(
        self,
        settings: Settings,
        store: UsageStore,
        pricer: Pricer,
        *,
        backoff: Backoff | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._settings = settings
        self._store = store
        self._pricer = pricer
        self._tracing = tracing
        self._topics = Topics(settings.topic_prefix)
        self.group_id = billing_group_id(settings)
        self._backoff = backoff or Backoff()
        self._batch_rows = max(1, settings.billing_batch_rows)
        self._batch_max_rows = max(self._batch_rows, settings.billing_batch_max_rows)
        self._batch_interval_s = max(0.0, settings.billing_batch_interval_s)
        self._insert_gap_s = settings.billing_insert_gap_s
        self._last_close_at: float | None = None
        """The event loop's time when the last batch closed (``close_at``)."""
        self._in_flight = asyncio.Lock()
        self._revoked: set[Any] = set()
        """Partitions revoked since the batch being gathered was fetched."""
        self._recent_capacity = settings.billing_recent_attempts
        self._recent_window_s = settings.billing_recent_window_s
        self._copy_skew_s = settings.billing_copy_skew_s
        self._recent: RecentAttempts | None = None
        """None until read back from ClickHouse: at the first batch and after assignments."""
        self.num_batches = 0
        self.num_inserted = 0
        """Attempts written to ClickHouse: each one once."""
        self.num_duplicates = 0
        """Copies of attempts left out: repeats within a batch and attempts already stored."""
        self.num_dead_letters = 0
        self.num_write_failures = 0
        """Failed lookups, inserts and dead-letter sends; each one is retried."""
        self.num_commit_failures = 0
        self.newest_created_at: float | None = None
        """The newest ``created_at`` (epoch s) of the events stored: billing lag's mark."""
        self.consumer: Any = None
        """The usage topic's consumer while ``run`` runs (its lag is a metric)."""
        self._heap_pins: list[bytes] | None = None
        """What keeps ``billing_heap_reserve_mb`` reserved, from the first ``consume`` on."""

    def rebalance_listener(self) -> ConsumerRebalanceListener:
        """Makes revoking wait until the batch in hand is inserted and committed."""
        return _FinishBatchBeforeRevoke(self)

    def stats(self) -> dict[str, int]:
        return {
            "num_batches": self.num_batches,
            "num_inserted": self.num_inserted,
            "num_duplicates": self.num_duplicates,
            "num_dead_letters": self.num_dead_letters,
            "num_write_failures": self.num_write_failures,
            "num_commit_failures": self.num_commit_failures,
        }

    async def run(self, stop: asyncio.Event) -> None:
        """Consumes until ``stop`` is set, then flushes the batch in hand and returns."""
        consumer = make_consumer(
            self._settings,
            group_id=self.group_id,
            background=True,
            max_partition_fetch_bytes=8 << 20,
        )
        consumer.subscribe([self._topics.usage], listener=self.rebalance_listener())
        self.consumer = consumer
        producer = make_producer(self._settings)
        await producer.start()
        try:
            await consumer.start()
            # What start-up made (modules, clients) lives as long as the sink: the
            # collections between batches need not walk it again and again.
            gc.freeze()
            spans = None
            if self._tracing is not None:
                spans = asyncio.create_task(self._tracing.run(publisher(producer), stop))
            try:
                log.info("billing sink consuming %s as %s", self._topics.usage, self.group_id)
                await self.consume(consumer, publisher(producer), stop)
            finally:
                await consumer.stop()
                if spans is not None:
                    await spans  # ``stop`` is set: it sends what is left and returns
        finally:
            await producer.stop()
            log.info("billing sink stopped: %s", self.stats())

    async def consume(self, consumer: UsageConsumer, publish: Publish, stop: asyncio.Event) -> None:
        """The loop of ``run``, on clients the caller started and will stop."""
        if self._heap_pins is None:  # each batch's objects reuse memory, not fresh pages
            self._heap_pins = reserve_heap(self._settings.billing_heap_reserve_mb)
        collector = _CollectorPause()
        while not stop.is_set():
            try:
                await self._next_and_handle(consumer, publish, stop, collector.pause)
            finally:
                collector.resume()  # the batch is freed: its frame is gone

    async def _next_and_handle(
        self,
        consumer: UsageConsumer,
        publish: Publish,
        stop: asyncio.Event,
        on_first_record: Callable[[], None],
    ) -> None:
        batch = await self._next_batch(consumer, stop, on_first_record)
        if batch:
            async with self._in_flight:
                await self._handle(batch, consumer, publish, stop)

    # Fetches --> one batch: batch_rows records (more if already fetched), or what came
    # by ``close_at``.
    async def _next_batch(
        self,
        consumer: UsageConsumer,
        stop: asyncio.Event,
        on_first_record: Callable[[], None] = lambda: None,
    ) -> Batch:
        loop = asyncio.get_running_loop()
        batch: Batch = {}
        num_records = 0
        deadline: float | None = None
        idle_wait_s = max(self._batch_interval_s, _MIN_IDLE_POLL_S)
        while num_records < self._batch_rows and not stop.is_set():
            if deadline is None:
                wait_s = idle_wait_s
            else:
                wait_s = deadline - loop.time()
                if wait_s <= 0:
                    break
                wait_s = min(wait_s, idle_wait_s)  # a stop is seen as soon as before a gap
            fetched = await consumer.getmany(
                timeout_ms=int(wait_s * 1000), max_records=self._batch_max_rows - num_records
            )
            if self._revoked:  # a rebalance: what was gathered before it may be stale
                batch = self._without_revoked(batch)
                num_records = sum(len(records) for records in batch.values())
            for tp, records in fetched.items():
                if records:
                    batch.setdefault(tp, []).extend(records)
                    num_records += len(records)
            if num_records and deadline is None:
                deadline = close_at(
                    loop.time(), self._last_close_at, self._batch_interval_s, self._insert_gap_s
                )
                on_first_record()
        if num_records:
            self._last_close_at = loop.time()
        return batch

    def _without_revoked(self, batch: Batch) -> Batch:
        """Drops the records of partitions revoked since they were fetched.

        Those partitions may be another member's now, which reads them again from the
        last commit; inserting them here could race its index of recent attempts. If one
        comes back to this member, its fetch position is reset to that commit.
        """
        if not self._revoked:
            return batch
        kept = {tp: records for tp, records in batch.items() if tp not in self._revoked}
        self._revoked.clear()
        return kept

    # Batch --> dead letters --> known keys --> one deduplicated insert --> offset commit.
    async def _handle(
        self, batch: Batch, consumer: UsageConsumer, publish: Publish, stop: asyncio.Event
    ) -> None:
        batch = self._without_revoked(batch)
        events: list[Usage] = []
        traced: list[tuple[Any, Usage]] = []  # (record headers, event): traced attempts
        for records in batch.values():
            read = decode_usages([record.value for record in records])
            if read is not None:  # the whole fetch, strictly: every one storable
                events += read
                if self._tracing is not None and any(map(_HEADERS, records)):
                    traced += [
                        (r.headers, e) for r, e in zip(records, read, strict=True) if r.headers
                    ]
                continue
            for record in records:
                try:
                    event = decode_usage(record.value)
                    check_storable(event)  # a poison event fails here, not in the insert
                except (SchemaError, UnstorableEvent) as exc:
                    if not await self._dead_letter(publish, record, str(exc), stop):
                        return
                else:
                    events.append(event)
                    if self._tracing is not None and record.headers:
                        traced.append((record.headers, event))
        if events:
            plan = await self._plan(events, stop)
            started_ns = time.time_ns()
            if plan is None or not await self._insert(plan, stop):
                return  # stopping mid-outage: uncommitted, so the batch is redelivered
            if traced:
                self._trace_insert(traced, started_ns, plan.num_rows)
            self.num_inserted += plan.num_rows
            self.num_duplicates += len(events) - plan.num_rows
            newest = max(map(_CREATED_AT, events)).timestamp()
            if self.newest_created_at is None or newest > self.newest_created_at:
                self.newest_created_at = newest
        self.num_batches += 1
        await self._commit(consumer, {tp: records[-1].offset + 1 for tp, records in batch.items()})

    def _trace_insert(
        self, traced: list[tuple[Any, Usage]], started_ns: int, num_rows: int
    ) -> None:
        """A ``billing.insert`` span per traced attempt of the batch, under the span its
        usage record carries (the worker's), over the batch's insert."""
        assert self._tracing is not None
        tracer = self._tracing.tracer
        ended_ns = time.time_ns()
        for headers, event in traced:
            end_span(
                tracer,
                "billing.insert",
                started_ns,
                ended_ns,
                {
                    **span_attributes(
                        tenant=event.tenant_id, request_id=event.request_id, attempt=event.attempt
                    ),
                    "tokenbus.num_rows": num_rows,
                },
                context=extract(headers),
                kind=SpanKind.CONSUMER,
            )

    async def _plan(self, events: list[Usage], stop: asyncio.Event) -> ColumnPlan | None:
        if self._recent is None and not await self._until_done(
            self._read_recent, stop, "read of the recent attempts"
        ):
            return None
        recent = self._recent
        assert recent is not None
        firsts = keyed_first_copies(events)
        keys = recent.unsure_keys(firsts)
        if any_resent(firsts):
            # A second attempt's request may have a billed run stored: looked up too.
            unsure = set(keys)
            keys += [key for key, _ in firsts if key[3] and key not in unsure]
        stored = Stored(set(), set())

        async def look_up() -> None:
            nonlocal stored
            stored = await asyncio.to_thread(self._store.look_up, keys)

        if keys and not await self._until_done(look_up, stop, f"lookup of {len(keys)} attempts"):
            return None
        return plan_keyed_columns(firsts, stored.keys, self._pricer, stored.billed)

    async def _read_recent(self) -> None:
        stored = await asyncio.to_thread(
            self._store.recent_attempts, self._recent_capacity, self._recent_window_s
        )
        self._recent = RecentAttempts.from_stored(
            stored.attempts,
            stored.complete_from,
            self._recent_capacity,
            margin_s=self._copy_skew_s,
        )
        log.info(
            "recent attempts: %d read back, complete from %s",
            len(self._recent),
            self._recent.horizon or "the start",
        )

    async def _insert(self, plan: ColumnPlan, stop: asyncio.Event) -> bool:
        if not plan.num_rows:
            return True

        async def insert() -> None:
            await asyncio.to_thread(
                self._store.insert_columns, plan.columns, dedup_token=plan.dedup_token
            )

        if not await self._until_done(insert, stop, f"insert of {plan.num_rows} usage rows"):
            return False
        if self._recent is not None:
            self._recent.add_ticks(plan.keys, plan.created_ticks)
        return True

    async def _dead_letter(
        self, publish: Publish, record: Any, reason: str, stop: asyncio.Event
    ) -> bool:
        sent = await dead_letter_until_sent(
            publish,
            self._topics,
            record,
            consumer=self.group_id,
            reason=reason,
            stop=stop,
            backoff=self._backoff,
            on_failure=self._failed,
        )
        if sent:
            self.num_dead_letters += 1
        return sent

    async def _until_done(
        self, attempt: Callable[[], Awaitable[None]], stop: asyncio.Event, what: str
    ) -> bool:
        """Retries ``attempt`` with backoff; False if ``stop`` was set while waiting."""
        return await until_done(attempt, stop, self._backoff, what, self._failed)

    def _failed(self) -> None:
        self.num_write_failures += 1

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
