"""``python -m billing.alerts``: budget alerts to the webhook, and the daily reconciliation.

# budget-alerts (group <prefix>-alerts) --> WebhookSender.deliver --> commit
# every budget_reconcile_interval_s --> billing.alerts.reconciler --> log, /metrics
# /healthz, /metrics on alerts_port

Commits: an alert's offset is committed only after its webhook answered 2xx (the
sender retries with backoff until it does), one record at a time, in order. A crash
before the commit sends that alert again on restart: nothing is lost, and the receiver
drops the repeat by ``X-Tokenbus-Alert-Id``. The job writes each threshold once per
period (its fired marks are in a changelog-backed table), so repeats come only from
that window. Without a webhook configured the service reads no alerts (and commits
none): a webhook set later gets them all.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry

from billing.alerts.reconciler import ReconcileMetrics, reconcile_forever
from billing.alerts.webhook import WebhookSender
from schemas import SchemaError, decode
from schemas.budgets import BudgetAlert
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.loops import run_service, until_stopped
from tokenbus.metrics import (
    ConsumerLagCollector,
    aiokafka_offsets,
    metrics_app,
    start_metrics_server,
)
from tokenbus.topics import Topics

log = logging.getLogger(__name__)


def alerts_group_id(settings: Settings) -> str:
    return f"{settings.topic_prefix}-alerts"


async def send_alerts(
    settings: Settings, sender: WebhookSender, consumers: dict[str, Any] | None = None
) -> None:
    """``consumers`` gets the alerts consumer under ``alerts`` (its lag is a metric)."""
    topics = Topics(settings.topic_prefix)
    consumer = make_consumer(
        settings, topics.budget_alerts, group_id=alerts_group_id(settings), background=True
    )
    if consumers is not None:
        consumers["alerts"] = consumer
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


def alerts_registry(
    metrics: ReconcileMetrics, consumers: dict[str, Any] | None = None
) -> CollectorRegistry:
    """Reconciliation drift and the alerts consumer's lag, through prometheus_client."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    lag = ConsumerLagCollector()
    held = consumers if consumers is not None else {}
    lag.track("alerts", aiokafka_offsets(lambda: held.get("alerts")))
    registry.register(lag)
    return registry


def create_app(metrics: ReconcileMetrics, consumers: dict[str, Any] | None = None) -> Any:
    return metrics_app(alerts_registry(metrics, consumers), lambda: {"status": "ok"})


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    metrics = ReconcileMetrics()
    consumers: dict[str, Any] = {}
    runner = await start_metrics_server(
        create_app(metrics, consumers), "127.0.0.1", settings.alerts_port
    )
    tasks = []
    if settings.budget_reconcile_interval_s > 0:
        tasks.append(asyncio.create_task(reconcile_forever(settings, metrics, stop)))
    if settings.budget_webhook_url and settings.budget_webhook_secret:
        sender = WebhookSender(settings.budget_webhook_url, settings.budget_webhook_secret)
        tasks.append(asyncio.create_task(send_alerts(settings, sender, consumers)))
    else:
        log.info("no TOKENBUS_BUDGET_WEBHOOK_URL/_SECRET: alerts stay on the topic")
    log.info("alerts on http://127.0.0.1:%d", settings.alerts_port)
    try:
        await until_stopped(stop, tasks)  # a loop that fails ends the service
    finally:
        await runner.cleanup()


def main() -> None:
    run_service(serve)


if __name__ == "__main__":
    main()
