"""What one fetch costs on the bundled broker as a partition grows, for several
``fetch_max_wait_ms``.

    .venvs/stream/bin/python -m bench.fetch_cost [--batches 1000 10000 30000 60000]

tansu 0.6.0 keeps a partition as one stored object per record batch, and a fetch costs
more the more batches the partition holds. It stops reading at ``fetch_max_wait_ms``:
once one fetch costs more than that, it answers with no records at all, every time, and
the consumer stands still behind the high-water mark for good. Reply topics are made of
small batches (one per engine step), so they grow fastest.

The partition is filled with one-record batches (several producers, each awaiting every
send). At each size, per wait, with ``tokenbus.tansu.fetch_wait`` off and on: a fetch 10
records behind the end (a tailing consumer), and how many records a consumer reads from
the start in ``--read-s`` seconds. And, empty and at each size, what a consumer tailing
the partition costs the broker while a producer appends ``--tail-rate`` records a second
(a client's reply reader at concurrency 1), in cores: why a client's reply topic rolls
(``Settings.reply_topic_roll_records``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from aiokafka import TopicPartition

from bench.common import bench_settings, exit_on_sigterm, make_console, print_table, progress
from bench.procstat import cpu_seconds
from bench.report import uptime_load, write_result
from bench.services import broker_only
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, make_consumer, make_producer

PRODUCERS = 4


async def fill(settings: Settings, topic: str, start: int, stop: int) -> None:
    """Appends records ``start`` to ``stop``, each in a batch of its own."""

    async def one(index: int) -> None:
        producer = make_producer(settings, linger_ms=0)
        await producer.start()
        try:
            for n in range(start + index, stop, PRODUCERS):
                await producer.send_and_wait(topic, f"record {n}".encode())
        finally:
            await producer.stop()

    await asyncio.gather(*(one(i) for i in range(PRODUCERS)))


async def probe(
    settings: Settings, tp: TopicPartition, wait_ms: int, read_s: float, rule: bool
) -> dict[str, Any]:
    """``rule``: with ``tokenbus.tansu.fetch_wait`` on, else as aiokafka ships."""
    cap_ms = settings.fetch_max_wait_cap_ms if rule else 0
    consumer = make_consumer(
        settings.model_copy(update={"fetch_max_wait_cap_ms": cap_ms}),
        group_id=None,
        fetch_max_wait_ms=wait_ms,
    )
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        consumer.seek(tp, max(0, end - 10))
        started = time.monotonic()
        tail = (await consumer.getmany(tp, timeout_ms=2000)).get(tp, [])
        tail_ms = (time.monotonic() - started) * 1000
        await consumer.seek_to_beginning(tp)
        read, started = 0, time.monotonic()
        while read < end and time.monotonic() - started < read_s:
            read += len((await consumer.getmany(tp, timeout_ms=200)).get(tp, []))
        return {
            "fetch_wait_rule": rule,
            "fetch_max_wait_ms": wait_ms,
            "tail_records": len(tail),
            "tail_ms": round(tail_ms, 1),
            "read_from_start": read,
            "read_s": round(time.monotonic() - started, 2),
        }
    finally:
        await consumer.stop()


async def tail_cost(
    settings: Settings, tp: TopicPartition, broker_pid: int, rate: float, num_records: int
) -> float:
    """The broker's cores while a consumer (the request path's fetch wait) tails ``tp``
    and a producer appends ``num_records`` one-record batches, ``rate`` a second."""
    consumer = make_consumer(settings, group_id=None)
    producer = make_producer(settings, linger_ms=0)
    await consumer.start()
    await producer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        read = 0

        async def tail() -> None:
            nonlocal read
            while read < num_records:
                read += len((await consumer.getmany(tp, timeout_ms=500)).get(tp, []))

        reader = asyncio.create_task(tail())
        await asyncio.sleep(0.3)  # its first fetches parked
        cpu, started = cpu_seconds(broker_pid), time.monotonic()
        for _ in range(num_records):
            await producer.send_and_wait(tp.topic, b"tail")
            await asyncio.sleep(1 / rate)
        await asyncio.wait_for(reader, 30)
        return (cpu_seconds(broker_pid) - cpu) / (time.monotonic() - started)
    finally:
        await producer.stop()
        await consumer.stop()


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    load_start = uptime_load()
    settings = bench_settings()
    rows: list[dict[str, Any]] = []
    tails: list[dict[str, Any]] = []
    async with broker_only(settings) as stack:
        topic = f"{settings.topic_prefix}.bench-fetch-cost"
        await ensure_topics(settings, {topic: 1})
        tp = TopicPartition(topic, 0)
        filled = 0

        async def tail_row() -> None:
            cores = await tail_cost(settings, tp, stack.pid("broker"), args.tail_rate, 100)
            tails.append({"batches": filled, "broker_cores": round(cores, 3)})

        with progress(make_console()) as bar:
            task = bar.add_task("fill, then fetch", total=len(args.batches))
            await tail_row()
            for batches in sorted(args.batches):
                await fill(settings, topic, filled, batches)
                filled = batches
                await tail_row()
                filled += 100  # the tail's own records
                for rule in (False, True):
                    for wait_ms in args.fetch_wait_ms:
                        row = await probe(settings, tp, wait_ms, args.read_s, rule)
                        rows.append({"batches": batches, **row})
                bar.advance(task)
    return {
        "load_start": load_start,
        "load_end": uptime_load(),
        "parameters": {"tail_rate": args.tail_rate},
        "results": rows,
        "tail": tails,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1000, 10_000, 30_000])
    parser.add_argument("--fetch-wait-ms", type=int, nargs="+", default=[5, 20, 100])
    parser.add_argument("--read-s", type=float, default=5.0)
    parser.add_argument("--tail-rate", type=float, default=30.0, help="records/s")
    args = parser.parse_args()
    exit_on_sigterm()
    result = asyncio.run(measure(args))
    path = write_result("fetch_cost", result)
    print_table(
        "one fetch on a partition of one-record batches (tansu)",
        [
            "batches",
            "tokenbus.tansu.fetch_wait",
            "fetch_max_wait_ms",
            "tail fetch: records",
            "tail fetch ms",
            f"read from start in {args.read_s:g} s",
        ],
        (
            [
                row["batches"],
                "on" if row["fetch_wait_rule"] else "off",
                row["fetch_max_wait_ms"],
                row["tail_records"],
                f"{row['tail_ms']:.1f}",
                row["read_from_start"],
            ]
            for row in result["results"]
        ),
        path,
    )
    print_table(
        f"a consumer tailing the partition, {args.tail_rate:g} records/s appended (tansu)",
        ["batches in the partition", "broker cores"],
        ([row["batches"], f"{row['broker_cores']:.3f}"] for row in result["tail"]),
        path,
    )


if __name__ == "__main__":
    main()
