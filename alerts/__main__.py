"""``python -m alerts``: sends every budget alert to the configured webhook.

# budget-alerts (group tokenbus-alerts) --> WebhookSender.deliver --> commit

Commits: an alert's offset is committed only after its webhook answered 2xx (the
sender retries with backoff until it does), one record at a time, in order. A crash
before the commit sends that alert again on restart: nothing is lost, and the receiver
drops the repeat by ``X-Tokenbus-Alert-Id``. The job writes each threshold once per
period (its fired marks are in a changelog-backed table), so repeats come only from
that window.
"""

from __future__ import annotations

import logging

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from alerts.webhook import WebhookSender
from schemas import SchemaError, decode
from schemas.budgets import BudgetAlert
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.loops import run
from tokenbus.topics import Topics

log = logging.getLogger(__name__)


async def send_alerts(settings: Settings, sender: WebhookSender) -> None:
    topics = Topics(settings.topic_prefix)
    consumer = make_consumer(settings, topics.budget_alerts, group_id="tokenbus-alerts")
    await consumer.start()
    try:
        async for record in consumer:
            try:
                alert = decode(BudgetAlert, record.value)
            except SchemaError as exc:
                log.warning("skipping an unreadable alert at %d: %s", record.offset, exc)
            else:
                assert record.value is not None
                await sender.deliver(alert.alert_id, record.value)
                log.info("alert %s delivered", alert.alert_id)
            partition = TopicPartition(record.topic, record.partition)
            await consumer.commit({partition: OffsetAndMetadata(record.offset + 1, "")})
    finally:
        await consumer.stop()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings()
    if not settings.budget_webhook_url or not settings.budget_webhook_secret:
        raise SystemExit("set TOKENBUS_BUDGET_WEBHOOK_URL and TOKENBUS_BUDGET_WEBHOOK_SECRET")
    sender = WebhookSender(settings.budget_webhook_url, settings.budget_webhook_secret)
    run(send_alerts(settings, sender), settings)


if __name__ == "__main__":
    main()
