"""``python -m billing``: the sinks (usage, budget alerts, spans) and the query server, until
SIGINT or SIGTERM.

This process owns the ClickHouse data (see ``billing.query_server`` for why that
matters with chdb). ``billing_report`` is re-exported here for the CLI.
"""

from __future__ import annotations

import asyncio
import logging

from clickhouse_connect.driver.exceptions import ClickHouseError

from billing.alert_sink import AlertSink
from billing.console import billing_report
from billing.metrics import billing_registry
from billing.query_server import create_app, start_query_server
from billing.sink import BillingSink
from billing.span_sink import SpanSink
from billing.storage import ClickHouseStore
from tokenbus import loops
from tokenbus.config import Settings
from tokenbus.cost import PeakHours
from tokenbus.kafka import ensure_topics
from tokenbus.metrics import aiokafka_offsets
from tokenbus.price_file import load_price_book
from tokenbus.pricing import Pricer
from tokenbus.topics import Topics
from tokenbus.tracing import Tracing

__all__ = ["billing_report", "main", "serve"]

log = logging.getLogger("billing")


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Runs the sink and the query server until ``stop`` is set."""
    topics = Topics(settings.topic_prefix)
    # A bad price file or peak-hours spec fails the start, before anything is consumed.
    pricer = Pricer(
        load_price_book(settings), PeakHours.parse(settings.peak_hours, settings.peak_hours_tz)
    )
    # The same topics as the local stack creates; existing ones are left alone.
    await ensure_topics(
        settings,
        {
            topics.usage: settings.num_partitions,
            topics.dead_letters: 1,
            topics.budget_alerts: 1,  # as the local stack makes it
            topics.spans: settings.num_partitions,
        },
    )
    # The writer migrates first; the query side gets a client of its own, read-only,
    # so outside SQL can never write and never waits on the sink's inserts.
    store = await _open_writer(settings.clickhouse)
    try:
        num_new = await asyncio.to_thread(store.sync_prices, pricer.book)
        log.info("price table: %d versions, %d new", len(pricer.book.prices), num_new)
        query_store = await asyncio.to_thread(
            ClickHouseStore, settings.clickhouse, migrate=False, read_only=True
        )
        try:
            # Its producer sends the spans of traced attempts' inserts (billing.insert).
            sink = BillingSink(settings, store, pricer, tracing=Tracing(settings, "billing"))
            alert_sink = AlertSink(settings, store)
            span_sink = SpanSink(settings, store)

            def stats() -> dict[str, int]:
                return {
                    **sink.stats(),
                    "num_alerts": alert_sink.num_alerts,
                    "num_spans": span_sink.num_spans,
                }

            registry = billing_registry(
                sink,
                aiokafka_offsets(lambda: sink.consumer, [topics.usage]),
                lambda: {"num_alerts_stored": alert_sink.num_alerts},
            )
            app = create_app(
                query_store,
                dsn=settings.clickhouse,
                stats=stats,
                registry=registry,
                job_metrics_url=settings.job_metrics,
                batch_metrics_url=settings.batch_metrics,
            )
            runner = await start_query_server(app, settings.billing_query_port)
            log.info(
                "billing: %s --> %s; queries on http://127.0.0.1:%d",
                topics.usage,
                settings.clickhouse,
                settings.billing_query_port,
            )
            try:
                # Usage, budget alerts and spans, each in its own group; one writer.
                await asyncio.gather(sink.run(stop), alert_sink.run(stop), span_sink.run(stop))
            finally:
                await runner.cleanup()
        finally:
            query_store.close()
    finally:
        store.close()


async def _open_writer(dsn: str, timeout_s: float = 15.0) -> ClickHouseStore:
    """Opens (and migrates) the store, waiting out a reader that holds a chdb directory.

    A CLI report run while no sink is up opens the directory itself for a moment
    (``billing.reader``, case c); chdb then refuses this process until it lets go.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await asyncio.to_thread(ClickHouseStore, dsn)
        except ClickHouseError as exc:
            if loop.time() > deadline:
                raise
            log.warning("cannot open %s yet, retrying: %s", dsn, exc)
            await asyncio.sleep(0.5)


def main() -> None:
    loops.run_service(serve)


if __name__ == "__main__":
    main()
