"""Spans --> ClickHouse ``spans``, for ``tokenbus trace``.

# spans (group <prefix>-billing-spans) --> SpanBatch, key == tenant --> span_rows()
# --> one insert per ``span_gather_s`` (Settings) --> offset commit

Write order: insert, then commit. Loses nothing: offsets are committed only for spans in
ClickHouse (or unreadable: those go to the dead-letter topic with the reason), so a crash
redelivers, and a redelivered span lands on its own key (tenant, trace, span), which the
table's ReplacingMergeTree keeps once. A batch whose record key is not its tenant is
refused: a service writes its tenants' spans under their own keys, and nothing else may
file spans under a tenant.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from aiokafka.errors import KafkaError

from billing.span_codec import decode_spans
from billing.traces import span_rows
from schemas import SchemaError
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter_until_sent
from tokenbus.kafka import Publish, make_consumer, make_producer, publisher
from tokenbus.retry import Backoff, until_done
from tokenbus.topics import Topics

log = logging.getLogger(__name__)

GATHER_RECORDS = 2_000
"""Span batches (records) in one insert at most, however long the gather."""
FETCH_WAIT_S = 0.5
"""The longest one fetch waits, so a stop is seen within it even during a long gather."""


class SpanStore(Protocol):
    def insert_spans(self, rows: Sequence[tuple[Any, ...]]) -> None: ...


class SpanSink:
    def __init__(
        self, settings: Settings, store: SpanStore, *, backoff: Backoff | None = None
    ) -> None:
        self._settings = settings
        self._store = store
        self._topics = Topics(settings.topic_prefix)
        self.group_id = f"{settings.topic_prefix}-billing-spans"
        self._gather_s = settings.span_gather_s
        self._backoff = backoff or Backoff()
        self.num_spans = 0
        self.num_refused = 0

    async def run(self, stop: asyncio.Event) -> None:
        consumer = make_consumer(
            self._settings, self._topics.spans, group_id=self.group_id, background=True
        )
        producer = make_producer(self._settings)
        await consumer.start()
        await producer.start()
        try:
            while not stop.is_set():
                batch = await self._gather(consumer, stop)
                records = [r for records in batch.values() for r in records]
                if not records:
                    continue
                rows = await self._rows(records, publisher(producer), stop)
                if rows is None or not await self._write(rows, stop):
                    continue  # stopping mid-outage: uncommitted, so redelivered
                offsets = {tp: rs[-1].offset + 1 for tp, rs in batch.items() if rs}
                try:
                    await consumer.commit(offsets)
                except KafkaError as exc:  # redelivered, then merged away by the key
                    log.warning("span offset commit failed: %s", exc)
        finally:
            await consumer.stop()
            await producer.stop()

    async def _gather(self, consumer: Any, stop: asyncio.Event) -> dict[Any, list[Any]]:
        """Records for one insert: what arrives within ``span_gather_s`` of the first
        one, up to ``GATHER_RECORDS``. Each insert has a fixed cost in ClickHouse, and
        spans are no hurry: one insert every few seconds rather than one per service's
        flush."""
        gathered: dict[Any, list[Any]] = {}
        num_records = 0
        deadline: float | None = None
        loop = asyncio.get_running_loop()
        while not stop.is_set() and num_records < GATHER_RECORDS:
            wait_s = FETCH_WAIT_S if deadline is None else min(FETCH_WAIT_S, deadline - loop.time())
            if wait_s <= 0:
                break
            batch = await consumer.getmany(
                timeout_ms=int(wait_s * 1000), max_records=GATHER_RECORDS - num_records
            )
            for tp, records in batch.items():
                gathered.setdefault(tp, []).extend(records)
                num_records += len(records)
            if deadline is None:
                if not num_records:
                    return gathered  # nothing yet: the caller looks at ``stop`` again
                deadline = loop.time() + self._gather_s
        return gathered

    async def _rows(
        self, records: list[Any], publish: Publish, stop: asyncio.Event
    ) -> list[tuple[Any, ...]] | None:
        """The records' span rows, the unreadable ones dead-lettered (a failed send is
        retried, as an insert is); None if ``stop`` was set while a send was failing."""
        rows: list[tuple[Any, ...]] = []
        for record in records:
            try:
                spans = decode_spans(record.value)
                if record.key != spans.tenant_id.encode():
                    raise SchemaError(f"a batch of tenant {spans.tenant_id!r} keyed {record.key!r}")
            except SchemaError as exc:
                sent = await dead_letter_until_sent(
                    publish,
                    self._topics,
                    record,
                    consumer=self.group_id,
                    reason=str(exc),
                    stop=stop,
                    backoff=self._backoff,
                )
                if not sent:
                    return None
                self.num_refused += 1
                continue
            rows.extend(span_rows(spans))
        return rows

    async def _write(self, rows: list[tuple[Any, ...]], stop: asyncio.Event) -> bool:
        async def insert() -> None:
            await asyncio.to_thread(self._store.insert_spans, rows)

        if not await until_done(insert, stop, self._backoff, f"insert of {len(rows)} spans"):
            return False
        self.num_spans += len(rows)
        return True
