"""``python -m batches``: the batch runner, with ``/healthz`` and ``/metrics`` on
``batch_port``.

# <prefix>.batches --> batches.runner.Runner --> one batches.run.BatchRun per batch
"""

from __future__ import annotations

import asyncio
import logging

from batches.metrics import RunnerMetrics
from batches.runner import Runner
from tokenbus.batch.store import BatchStore
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, wait_for_broker
from tokenbus.loops import run_service, until_stopped
from tokenbus.metrics import metrics_app, start_metrics_server
from tokenbus.topics import Topics

log = logging.getLogger(__name__)


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    await wait_for_broker(settings, timeout_s=30)
    await ensure_topics(settings, {Topics(settings.topic_prefix).batches: settings.num_partitions})
    metrics = RunnerMetrics()
    runner = Runner(settings, BatchStore(settings.batch_store), metrics)
    app = metrics_app(metrics.registry, lambda: {"status": "ok"})
    site_runner = await start_metrics_server(app, "127.0.0.1", settings.batch_port)
    log.info("batch runner on http://127.0.0.1:%d", settings.batch_port)
    try:
        # A runner that fails ends the service.
        await until_stopped(stop, [asyncio.create_task(runner.serve())])
    finally:
        await site_runner.cleanup()


def main() -> None:
    run_service(serve)


if __name__ == "__main__":
    main()
