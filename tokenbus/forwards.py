"""Reads back requests the job forwarded, from their workers' topics: for a job that
adopts the requests an earlier run of it (or another instance) had in flight
(``stream_jobs.ledger``, ``Forward``).

# Forward (worker topic, partition, offset) --> the record there --> its value

A thin I/O shell: one consumer with no group, assigned and positioned per read, so it
commits nothing and disturbs no worker. Each partition is read from the lowest offset
asked for until the highest one is passed, or the broker has nothing more (a record
lost to retention is then simply not found, and the caller says so).
"""

from __future__ import annotations

import time
from collections import defaultdict

from aiokafka import AIOKafkaConsumer, TopicPartition

from tokenbus.config import Settings
from tokenbus.kafka import make_consumer

MAX_READ_S = 60.0
CAUGHT_UP_MS = 1_000
"""A fetch that stays empty this long: the partition has nothing more."""

Place = tuple[str, int, int]
"""(topic, partition, offset) of one record."""


class KafkaForwardLog:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    async def read(self, places: list[Place]) -> dict[Place, bytes]:
        """The value of the record at each place that still holds one."""
        wanted: dict[TopicPartition, set[int]] = defaultdict(set)
        for topic, partition, offset in places:
            wanted[TopicPartition(topic, partition)].add(offset)
        if not wanted:
            return {}
        consumer = make_consumer(self._settings, group_id=None)
        await consumer.start()
        try:
            consumer.assign(list(wanted))
            for tp, offsets in wanted.items():
                consumer.seek(tp, min(offsets))
            return await _read(consumer, wanted)
        finally:
            await consumer.stop()


async def _read(
    consumer: AIOKafkaConsumer, wanted: dict[TopicPartition, set[int]]
) -> dict[Place, bytes]:
    found: dict[Place, bytes] = {}
    left = {tp: max(offsets) for tp, offsets in wanted.items()}
    deadline = time.monotonic() + MAX_READ_S
    while left and time.monotonic() < deadline:
        fetched = await consumer.getmany(*left, timeout_ms=CAUGHT_UP_MS)
        if not fetched:
            break  # caught up: what was not found is not there
        for tp, records in fetched.items():
            for record in records:
                if record.offset in wanted[tp] and record.value is not None:
                    found[(tp.topic, tp.partition, record.offset)] = record.value
            if records and records[-1].offset >= left.get(tp, -1):
                left.pop(tp, None)
                consumer.pause(tp)
    return found
