"""The Faust job's fetch wait, bounded, and short after a quiet spell (tansu profile
only).

Faust hard-codes ``fetch_max_wait_ms=1500`` for its consumer. The bundled broker answers
a parked fetch later the longer its wait, and the job holds many partitions: one left
out of a parked fetch waits for that fetch to end (``Settings.job_fetch_max_wait_ms``).
Apache Kafka answers a parked fetch as soon as a record arrives, so Faust's wait is
fine there and the ``kafka`` profile leaves Faust as it ships.
"""

from __future__ import annotations

from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka

from tokenbus.tansu import fetch_wait
from tokenbus.tansu.patch import Patch

_patch = Patch(faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer")
_installed: dict[str, Any] = {}


def bound_faust_fetch_wait(wait_ms: int) -> None:
    """Installs the wait in Faust's consumer factory for this process (idempotent)."""
    _installed["wait_ms"] = wait_ms
    if _patch.on:
        return
    original = _patch.original()

    def create(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = _installed["wait_ms"]
        # A lone record after a quiet spell (a usage record: a request's end) is followed
        # by a program's next request: fetch briefly for it (tokenbus.tansu.fetch_wait).
        fetch_wait.expect_after_quiet(consumer)
        return consumer

    _patch.put(create)


def uninstall() -> None:
    """Faust's consumer factory as it ships again."""
    _patch.undo()
    _installed.clear()
