"""Pretend workers for the admission benchmarks: heartbeats only, no engine.

The job routes to any worker whose heartbeat it has seen; a pretend worker announces a
request topic and a huge ``max_num_seqs`` (so it never looks loaded), and the benchmark
counts what the job forwards there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from datetime import datetime

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import WorkerStatus, encode
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.topics import Topics

HEARTBEAT_S = 0.25


def pretend_ids(num_workers: int) -> list[str]:
    return [f"pretend-{i}" for i in range(num_workers)]


async def heartbeat_loop(
    settings: Settings, producer: AIOKafkaProducer, worker_ids: list[str]
) -> None:
    topics = Topics(settings.topic_prefix)
    while True:
        for worker_id in worker_ids:
            status = WorkerStatus(
                worker_id=worker_id,
                model=settings.served_model_name,
                request_topic=topics.worker(worker_id),
                max_num_seqs=1_000_000,
            )
            await producer.send_and_wait(topics.heartbeats, encode(status), key=worker_id.encode())
        await asyncio.sleep(HEARTBEAT_S)


@dataclass
class ForwardCounter:
    """Counts the records the job forwarded to the pretend workers' topics."""

    settings: Settings
    worker_ids: list[str]
    num_forwarded: int = 0
    last_at: float = 0.0
    last_dispatched_at: float | None = None
    """The job's ``dispatched_at`` (epoch seconds) of the last record counted."""
    by_worker: dict[str, int] = field(default_factory=dict)
    _consumer: AIOKafkaConsumer | None = None
    _task: asyncio.Task[None] | None = None
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        topics = Topics(self.settings.topic_prefix)
        names = {topics.worker(w): w for w in self.worker_ids}
        self._consumer = make_consumer(self.settings, group_id=None)
        await self._consumer.start()
        self._consumer.assign([TopicPartition(name, 0) for name in names])
        await self._consumer.seek_to_beginning()
        self._task = asyncio.create_task(self._count(names))

    async def _count(self, names: dict[str, str]) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=100, max_records=10_000)
            for tp, records in batches.items():
                if records:
                    worker = names[tp.topic]
                    self.by_worker[worker] = self.by_worker.get(worker, 0) + len(records)
                    self.num_forwarded += len(records)
                    self.last_at = time.perf_counter()
                    self.last_dispatched_at = _dispatched_at(records[-1].value)
                    self._arrived.set()

    async def wait_for(self, count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.num_forwarded < count:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def next_arrival(self, timeout_s: float) -> float:
        """Waits for the next forwarded record; returns when it arrived (perf_counter)."""
        self._arrived.clear()
        await asyncio.wait_for(self._arrived.wait(), timeout=timeout_s)
        return self.last_at

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()


def _dispatched_at(value: bytes | None) -> float | None:
    """When the job picked the worker for a forwarded WorkItem (its own wall clock)."""
    try:
        stamp = orjson.loads(value or b"null")["dispatched_at"]
        return datetime.fromisoformat(stamp).timestamp() if stamp else None
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
