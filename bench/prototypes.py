"""Tuning prototypes: the changes the backlog proposes, applied by monkeypatching, so a
benchmark can measure a proposal before anyone edits the hot path.

    BENCH_PROTOTYPES=pipelined_dispatch python -m bench.patched_job

Each prototype mirrors the diff sketched in BENCHMARKS.md ("Tuning backlog"). They reach
into private attributes of the code as it was measured; if that code moves, a prototype
fails loudly at start rather than measuring something else.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

ENV = "BENCH_PROTOTYPES"


def pipelined_dispatch() -> None:
    """Dispatcher.run forwards without awaiting each broker ack before the next pick.

    Landed in ``Dispatcher.run`` (backlog item 1); applied now, it swaps in this
    equivalent loop, so the rows measured with it before it landed still reproduce.
    Before, every forward is ``await publish(...)`` in the single dispatch loop, so the job
    forwards at most one request per produce round trip. Here each forward becomes a task;
    one ``sleep(0)`` lets it register as in flight (so ``_has_room`` stays exact) and hand
    its record to the producer before the loop picks the next one, which keeps the
    order of records per worker topic.
    """
    from stream_jobs import dispatcher

    cls: Any = dispatcher.Dispatcher
    names = ("_queue", "_waiting", "_registry", "_has_room", "_dispatch", "_recover_from")
    for name in (*names, "_update_tier", "_wake"):
        if name not in cls.__init__.__code__.co_names and not hasattr(cls, name):
            raise RuntimeError(f"prototype pipelined_dispatch: Dispatcher has no {name}")

    async def run(self: Any) -> None:
        pending: set[asyncio.Task[None]] = set()

        async def forward(waiting: Any) -> None:
            try:
                outcome = await self._dispatch(waiting)
            except Exception as exc:
                waiting.done.set_exception(exc)
            else:
                waiting.done.set_result(outcome)

        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.05)
            except TimeoutError:
                pass
            self._wake.clear()
            for run in self._registry.reap(time.monotonic()):
                self._recover_from(run)
            while (priority := self._queue.peek_priority()) is not None:
                if not self._has_room(priority):
                    break
                waiting = self._queue.pop(priority)
                # Waiting requests are keyed by (tenant, request id): ids are per tenant.
                self._waiting.pop((waiting.request.tenant_id, waiting.request.request_id), None)
                task = asyncio.create_task(forward(waiting))
                pending.add(task)
                task.add_done_callback(pending.discard)
                await asyncio.sleep(0)  # runs forward() up to its publish: in flight, in order
            self._update_tier()

    cls.run = run


def client_batched_reads() -> None:
    """TokenbusClient reads its reply topic with ``getmany`` and waits with one
    ``asyncio.timeout`` per chunk instead of ``asyncio.wait_for`` (a task per chunk)."""
    from producers import client as client_module
    from schemas import TokenChunkBatch, decode
    from schemas.codec import SchemaError

    cls: Any = client_module.TokenbusClient

    # Streams are keyed by (tenant, request id), as ``watch`` and the real client key them:
    # request ids are unique only within a tenant.
    async def stream(self: Any, request: Any) -> Any:
        key = (request.tenant_id, request.request_id)
        queue = self._streams.setdefault(key, asyncio.Queue())
        expected = 0
        try:
            while True:
                try:
                    async with asyncio.timeout(self._settings.client_timeout_s):
                        chunk = await queue.get()
                except TimeoutError:
                    raise client_module.TokenbusTimeout(
                        f"no reply to {request.request_id}"
                    ) from None
                if chunk.seq < expected:
                    continue
                expected = chunk.seq + 1
                yield chunk
                if chunk.is_last:
                    return
        finally:
            self._streams.pop(key, None)
            self._created.pop(key, None)

    async def read_replies(self: Any) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=1000)
            for records in batches.values():
                for record in records:
                    try:
                        batch = decode(TokenChunkBatch, record.value)
                    except SchemaError:
                        continue  # the real client dead-letters it; not on the bench path
                    for chunk in batch.chunks:
                        queue = self._streams.get((batch.tenant_id, chunk.request_id))
                        if queue is not None:
                            queue.put_nowait(chunk)

    cls.stream = stream
    cls._read_replies = read_replies


def fast_partitioner() -> None:
    """Producers skip the pure-Python murmur2 hash when a topic has one partition (every
    reply topic), by passing aiokafka a partitioner with that fast path."""
    from aiokafka.partitioner import DefaultPartitioner

    from tokenbus import kafka

    default = DefaultPartitioner()

    def partition(key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if len(all_partitions) == 1:
            return all_partitions[0]
        return int(default(key, all_partitions, available))

    original = kafka.make_producer

    def make_producer(settings: Any, **overrides: Any) -> Any:
        return original(settings, **{"partitioner": partition, **overrides})

    kafka.make_producer = make_producer
    import workers.worker

    workers.worker.make_producer = make_producer  # type: ignore[attr-defined]


def trace_admission() -> None:
    """Not a change: timestamps inside the job. Each request's ``created_at`` (set by
    the producer just before it sends) against the moment ``handle_request`` starts
    (broker hop + Faust's consumer and stream), and against the moment it returns
    (queue + forward acknowledged). Every 2 s or so the job prints a ``bench trace`` line
    covering the requests since the previous line."""
    import json
    import time
    from datetime import datetime

    import orjson

    from bench.stats import summarize
    from stream_jobs import dispatcher

    cls: Any = dispatcher.Dispatcher
    original = cls.handle_request
    to_entry: list[float] = []
    to_return: list[float] = []
    last_print = [time.monotonic()]

    async def handle_request(self: Any, *args: Any) -> Any:
        entered = time.time()
        try:
            created = datetime.fromisoformat(orjson.loads(args[4])["created_at"]).timestamp()
        except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            created = None
        outcome = await original(self, *args)
        if created is not None:
            to_entry.append(entered - created)
            to_return.append(time.time() - created)
        if time.monotonic() - last_print[0] > 2.0 and to_entry:
            last_print[0] = time.monotonic()
            summary = {
                "created_to_handle_ms": summarize(to_entry, 1000),
                "created_to_forwarded_ms": summarize(to_return, 1000),
            }
            print("bench trace: " + json.dumps(summary), flush=True)
            to_entry.clear()  # each line covers the 2 s since the previous one
            to_return.clear()
        return outcome

    cls.handle_request = handle_request


def short_gil_switch() -> None:
    """The job's consumer runs in a thread of its own (Faust's consumer thread) and hands
    records to the main loop; each hand-off may wait for the GIL, which CPython passes
    every 5 ms by default. A 0.5 ms switch interval shows whether that wait matters."""
    import sys

    sys.setswitchinterval(0.0005)


PROTOTYPES: dict[str, Callable[[], None]] = {
    "short_gil_switch": short_gil_switch,
    "trace_admission": trace_admission,
    "pipelined_dispatch": pipelined_dispatch,
    "client_batched_reads": client_batched_reads,
    "fast_partitioner": fast_partitioner,
}


def apply_from_env() -> list[str]:
    names = [n for n in os.environ.get(ENV, "").split(",") if n]
    for name in names:
        if name not in PROTOTYPES:
            raise SystemExit(f"unknown prototype {name!r}; known: {sorted(PROTOTYPES)}")
        PROTOTYPES[name]()
    return names
