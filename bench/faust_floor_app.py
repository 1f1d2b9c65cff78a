"""``python -m bench.faust_floor_app``: the least a Faust agent does to admit a request.

The job's Faust app as the job configures it (``stream_jobs.app.faust_app``), with one
agent on the class 1 request topic that does only what admission cannot skip, in the
job's own pattern (events taken without auto-ack, each acked once its forward is
acknowledged):

- ``forward``: produce the record's value, unread, to the pretend worker's topic;
- ``ledger``: that, and one write to a changelog-backed table per request, as the job's
  request ledger writes (its records straight to aiokafka, ``stream_jobs.changelog``).

No decoding, checks, quota window, routing or tracing: ``bench.faust_floor`` runs it
beside ``bench.admission`` to show how much of the job's CPU per request is Faust's and
aiokafka's, whatever the dispatcher does. ``BENCH_FLOOR_MODE`` and ``BENCH_FLOOR_TO``
(the worker topic) say what to run.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import faust

from stream_jobs.app import faust_app
from stream_jobs.changelog import DirectChangelog, direct_table
from tokenbus import loops
from tokenbus.config import Settings
from tokenbus.logs import logging_config, setup_logging
from tokenbus.topics import Topics

MODES = ("forward", "ledger")


def create_floor_app(settings: Settings, mode: str, forward_to: str) -> faust.App:
    if mode not in MODES:
        raise ValueError(f"BENCH_FLOOR_MODE must be one of {MODES}, not {mode!r}")
    app = faust_app(settings)
    topic = app.topic(Topics(settings.topic_prefix).requests(1), key_type=bytes, value_type=bytes)
    # The job's own kind of table: its changelog records go straight to aiokafka.
    ledger = direct_table(app, DirectChangelog(app), "floor-ledger", settings.num_partitions)

    @app.agent(topic, name="floor_admit")
    async def admit(stream: Any) -> None:
        source = stream.noack()
        sent: set[asyncio.Future[Any]] = set()
        async for event in source.events():
            message = event.message
            if mode == "ledger":
                ledger[message.key] = b"1"  # a changelog record, on the event's partition
            future = await app.producer.send(
                forward_to, message.key, message.value, None, None, None
            )
            acked = asyncio.ensure_future(_ack_when_sent(source, event, future))
            sent.add(acked)
            acked.add_done_callback(sent.discard)

    return app


async def _ack_when_sent(source: Any, event: Any, future: Any) -> None:
    await future
    await source.ack(event)


def main() -> int:
    settings = Settings()
    setup_logging(settings, configure_root=False)
    loops.install_policy(settings)
    app = create_floor_app(
        settings, os.environ.get("BENCH_FLOOR_MODE", "forward"), os.environ["BENCH_FLOOR_TO"]
    )
    worker = faust.Worker(app, loglevel="INFO", quiet=True, logging_config=logging_config(settings))
    worker.execute_from_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
