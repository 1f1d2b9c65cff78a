"""Does a tailing consumer read every record when several producers write one partition
at once? With and without ``tokenbus.tansu.gaps`` (``kafka_gap_settle_s``).

    .venvs/stream/bin/python -m bench.gaps [--producers 4] [--records 3000] [--runs 3]

Each run produces ``records`` per producer, concurrently, into a fresh one-partition
topic, while a consumer tails it from the start; a second consumer then reads the topic
from the beginning. "skipped" counts records the tailing consumer never saw although the
broker had stored them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from aiokafka import TopicPartition

from bench.common import bench_settings, exit_on_sigterm, make_console, print_table, progress
from bench.report import uptime_load, write_result
from bench.services import broker_only
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, make_consumer, make_producer
from tokenbus.tansu import gaps


async def read_all(
    settings: Settings, tp: TopicPartition, want: int, timeout_s: float, seen: set[bytes]
) -> set[bytes]:
    """Reads from the beginning into ``seen`` until it holds ``want`` or time is up."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = time.monotonic() + timeout_s
        while len(seen) < want and time.monotonic() < deadline:
            batches = await consumer.getmany(tp, timeout_ms=300)
            seen |= {record.value for record in batches.get(tp, []) if record.value}
        return seen
    finally:
        await consumer.stop()


async def one_run(settings: Settings, topic: str, producers: int, records: int) -> dict[str, Any]:
    await ensure_topics(settings, {topic: 1})
    tp = TopicPartition(topic, 0)
    want = producers * records
    tailed: set[bytes] = set()
    tail = asyncio.create_task(read_all(settings, tp, want, 60, tailed))
    await asyncio.sleep(0.5)  # the tail is positioned before the first record

    async def produce(index: int) -> None:
        producer = make_producer(settings)
        await producer.start()
        try:
            acks = []
            for n in range(records):
                acks.append(await producer.send(topic, f"p{index}-{n}".encode()))
                if random.random() < 0.3:
                    await asyncio.sleep(random.random() * 0.002)
            await asyncio.gather(*acks)
        finally:
            await producer.stop()

    await asyncio.gather(*(produce(i) for i in range(producers)))
    await asyncio.wait([tail], timeout=10)  # what the tail has not read by then, it skipped
    tail.cancel()
    stored = await read_all(settings, tp, want, 20, set())
    return {"produced": want, "stored": len(stored), "skipped": len(stored - tailed)}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    load_start = uptime_load()
    rows: list[dict[str, Any]] = []
    for settle_s in (0.0, args.settle_s):
        settings = bench_settings(kafka_gap_settle_s=settle_s)
        # Off means aiokafka as it ships: remove a check an earlier run installed.
        if settle_s == 0:
            gaps.uninstall()
        async with broker_only(settings):
            with progress(make_console()) as bar:
                task = bar.add_task(f"kafka_gap_settle_s={settle_s}", total=args.runs)
                for run in range(args.runs):
                    topic = f"{settings.topic_prefix}.bench-gaps.{run}"  # under the watched prefix
                    row = await one_run(settings, topic, args.producers, args.records)
                    rows.append({"kafka_gap_settle_s": settle_s, "run": run, **row})
                    bar.advance(task)
    return {"load_start": load_start, "load_end": uptime_load(), "results": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--records", type=int, default=3000, help="per producer")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=Settings().kafka_gap_settle_s)
    args = parser.parse_args()
    exit_on_sigterm()
    result = asyncio.run(measure(args))
    path = write_result("gaps", result)
    print_table(
        f"{args.producers} producers on one partition, a tailing consumer",
        ["kafka_gap_settle_s", "run", "produced", "stored", "skipped by the tail"],
        (
            [row[k] for k in ("kafka_gap_settle_s", "run", "produced", "stored", "skipped")]
            for row in result["results"]
        ),
        path,
    )


if __name__ == "__main__":
    main()
