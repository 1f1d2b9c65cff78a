"""Budget alerts --> ClickHouse ``budget_alerts``, for the dashboard: each alert once.

# budget-alerts (group <prefix>-billing-alerts) --> decode --> known ids left out
# --> one insert (with a dedup token) --> offset commit

Write order, the usage sink's (``billing.sink``): insert, then commit. A batch's alerts
that ClickHouse already holds (by tenant and alert id, the table's key) are left out,
and the insert carries a digest of its keys as ``insert_deduplication_token``, so a
retried or redelivered batch adds nothing: each alert is one row, read without FINAL.
Loses nothing: offsets are committed only for alerts in ClickHouse (or unreadable, and
logged), so a crash redelivers. The webhook (``python -m billing.alerts``) reads the same topic
in a group of its own; neither waits for the other.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from aiokafka.errors import KafkaError

from billing.alert_rows import AlertKey, alert_key, alert_row
from schemas import SchemaError, decode
from schemas.budgets import BudgetAlert
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.retry import Backoff, until_done
from tokenbus.topics import Topics

log = logging.getLogger(__name__)


class AlertStore(Protocol):
    """Where alert rows go. Calls come from one thread at a time."""

    def existing_alert_keys(self, keys: Sequence[AlertKey]) -> set[AlertKey]: ...

    def insert_alerts(self, rows: Sequence[tuple[Any, ...]], *, dedup_token: str) -> None: ...


def write_alerts(store: AlertStore, alerts: Sequence[BudgetAlert]) -> int:
    """Inserts the alerts the store does not hold yet; returns how many."""
    firsts = list({alert_key(a): a for a in reversed(alerts)}.values())[::-1]
    known = store.existing_alert_keys([alert_key(a) for a in firsts])
    new = [a for a in firsts if alert_key(a) not in known]
    if new:
        keys = "\n".join("\t".join(alert_key(a)) for a in new)
        token = hashlib.sha256(keys.encode()).hexdigest()
        store.insert_alerts([alert_row(a) for a in new], dedup_token=token)
    return len(new)


class AlertSink:
    def __init__(
        self, settings: Settings, store: AlertStore, *, backoff: Backoff | None = None
    ) -> None:
        self._settings = settings
        self._store = store
        self._topics = Topics(settings.topic_prefix)
        self.group_id = f"{settings.topic_prefix}-billing-alerts"
        self._backoff = backoff or Backoff()
        self.num_alerts = 0

    async def run(self, stop: asyncio.Event) -> None:
        consumer = make_consumer(
            self._settings, self._topics.budget_alerts, group_id=self.group_id, background=True
        )
        await consumer.start()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=500, max_records=500)
                records = [r for records in batch.values() for r in records]
                if not records or not await self._write(records, stop):
                    continue
                offsets = {tp: rs[-1].offset + 1 for tp, rs in batch.items() if rs}
                try:
                    await consumer.commit(offsets)
                except KafkaError as exc:  # redelivered, then left out as known
                    log.warning("alert offset commit failed: %s", exc)
        finally:
            await consumer.stop()

    async def _write(self, records: list[Any], stop: asyncio.Event) -> bool:
        alerts = []
        for record in records:
            try:
                alerts.append(decode(BudgetAlert, record.value))
            except SchemaError as exc:
                log.warning("skipping an unreadable alert at %d: %s", record.offset, exc)

        async def write() -> None:
            self.num_alerts += await asyncio.to_thread(write_alerts, self._store, alerts)

        return await until_done(write, stop, self._backoff, f"insert of {len(alerts)} alerts")
