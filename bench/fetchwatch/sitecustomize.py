"""Where a request waits on its way into the Faust job: put this directory on
``PYTHONPATH`` and the job's process (``python -m stream_jobs``; no other) writes one
line per event to ``$FETCHWATCH_DIR/<pid>`` (default ``/tmp/fetchwatch``):

    F <topic> <partition> <offset> <sent_ms> <at>   Faust's consumer thread hands the record
                                                     over (``_fetch_records`` returns it)
    A <topic> <partition> <offset> <at>              ``Dispatcher.admit`` starts on it
    P <request_id> <at>                              ``Dispatcher._pick`` chooses its worker
    R <started> <ended> <has_data> <partitions>      one fetch request of an aiokafka
                                                     consumer in the process, start to end

``sent_ms`` is the record's timestamp (its producer's CreateTime, whole milliseconds);
``at``, ``started`` and ``ended`` are ``time.time()``. Only the request topics' records
are written. ``python -m bench.fetch_legs /tmp/fetchwatch`` sums them up.

    rm -rf /tmp/fetchwatch
    PYTHONPATH=bench/fetchwatch .venvs/stream/bin/python -m bench.admission --requests 500
    .venvs/stream/bin/python -m bench.fetch_legs /tmp/fetchwatch

A diagnostic, not a benchmark: it wraps four methods of the job's process (Faust's
consumer thread, aiokafka's fetcher, the dispatcher's admission and pick) and writes a
line for each of their calls.
"""

from __future__ import annotations

import builtins
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("FETCHWATCH_DIR", "/tmp/fetchwatch")
_import = builtins.__import__
_installed: list[bool] = []


def _install(out: Any) -> None:
    from aiokafka.consumer import fetcher as aiokafka_fetcher
    from faust.transport.drivers import aiokafka as faust_aiokafka

    from stream_jobs import dispatcher

    fetch_request = aiokafka_fetcher.Fetcher._proc_fetch_request

    async def _proc_fetch_request(self: Any, assignment: Any, node_id: Any, request: Any) -> Any:
        started = time.time()
        has_data = await fetch_request(self, assignment, node_id, request)
        partitions = sum(len(parts) for _, parts in request._topics)
        out.write(f"R {started:.6f} {time.time():.6f} {int(bool(has_data))} {partitions}\n")
        return has_data

    fetch_records = faust_aiokafka.AIOKafkaConsumerThread._fetch_records

    async def _fetch_records(self: Any, consumer: Any, active: Any, **kwargs: Any) -> Any:
        records = await fetch_records(self, consumer, active, **kwargs)
        at = time.time()
        for tp, batch in (records or {}).items():
            if ".requests." in tp.topic:
                for record in batch:
                    out.write(
                        f"F {tp.topic} {tp.partition} {record.offset} {record.timestamp} {at:.6f}\n"
                    )
        return records

    admit = dispatcher.Dispatcher.admit

    async def _admit(self: Any, record: Any) -> Any:
        out.write(f"A {record.topic} {record.partition} {record.offset} {time.time():.6f}\n")
        return await admit(self, record)

    pick = dispatcher.Dispatcher._pick

    def _pick(self: Any, waiting: Any) -> Any:
        out.write(f"P {waiting.request.request_id} {time.time():.6f}\n")
        return pick(self, waiting)

    setattr(aiokafka_fetcher.Fetcher, "_proc_fetch_request", _proc_fetch_request)  # noqa: B010
    setattr(faust_aiokafka.AIOKafkaConsumerThread, "_fetch_records", _fetch_records)  # noqa: B010
    setattr(dispatcher.Dispatcher, "admit", _admit)  # noqa: B010
    setattr(dispatcher.Dispatcher, "_pick", _pick)  # noqa: B010


def _watching_import(name: str, *args: Any, **kwargs: Any) -> Any:
    """Installs the wrappers once the modules they wrap are whole (imported in full)."""
    module = _import(name, *args, **kwargs)
    if not _installed:
        faust_driver = sys.modules.get("faust.transport.drivers.aiokafka")
        ours = sys.modules.get("stream_jobs.dispatcher")
        app = sys.modules.get("stream_jobs.app")
        if (
            hasattr(faust_driver, "AIOKafkaConsumerThread")
            and hasattr(ours, "Dispatcher")
            and hasattr(app, "create_app")
        ):
            _installed.append(True)
            builtins.__import__ = _import
            os.makedirs(_DIR, exist_ok=True)
            _install(open(os.path.join(_DIR, str(os.getpid())), "a", buffering=1))
    return module


if "stream_jobs" in " ".join(getattr(sys, "orig_argv", sys.argv)):
    builtins.__import__ = _watching_import
