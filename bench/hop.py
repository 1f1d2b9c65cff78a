"""The physical floor: one loopback produce --> consume hop through the bundled broker,
and what an idle consumer costs, for several ``fetch_max_wait_ms``.

    .venvs/stream/bin/python -m bench.hop
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from aiokafka import TopicPartition
from rich.console import Console
from rich.table import Table

from bench.common import bench_settings, exit_on_sigterm, make_console, progress
from bench.procstat import CpuMeter
from bench.report import uptime_load, write_result
from bench.services import broker_only
from bench.stats import summarize
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, make_consumer, make_producer

TOPIC = "bench.hop"


async def one_setting(
    settings: Settings,
    num_partitions: int,
    wait_ms: int,
    num_messages: int,
    idle_s: float,
    broker_pid: int,
    on_step: Any,
    pause_ms: float = 50.0,
) -> dict[str, Any]:
    producer = make_producer(settings)
    consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=wait_ms)
    await producer.start()
    await consumer.start()
    try:
        # The consumer holds every partition, as the Faust job does; records go to one.
        tps = [TopicPartition(TOPIC, p) for p in range(num_partitions)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)
        # Idle first: what a quiet consumer costs the broker and itself.
        meter = CpuMeter({"broker": [broker_pid]})
        meter.start()
        cpu_self = time.process_time()
        await asyncio.sleep(idle_s)
        idle = meter.delta()
        idle_self = time.process_time() - cpu_self
        hops: list[float] = []
        for i in range(num_messages):
            sent = time.perf_counter()
            await producer.send_and_wait(TOPIC, str(i).encode(), partition=0)
            acked = time.perf_counter()
            while True:
                # tansu never answers a fetch with fetch_max_wait_ms=0: bound the wait.
                record = await asyncio.wait_for(consumer.getone(), timeout=10)
                if record.value == str(i).encode():
                    break
            hops.append(time.perf_counter() - sent)
            if i == 0:
                first_ack = acked - sent
            on_step()
            # A pause between messages, as a quiet topic sees them: the consumer's fetch
            # is parked in the broker when the record arrives. tansu 0.6.0 answers a
            # fetch parked for long later than one parked for 2 ms (the old pause).
            await asyncio.sleep(pause_ms / 1000 * (0.5 + random.random()))
        return {
            "fetch_max_wait_ms": wait_ms,
            "num_partitions": num_partitions,
            "pause_ms": pause_ms,
            "hop_ms": summarize(hops, 1000),
            "first_ack_ms": round(first_ack * 1000, 3),
            "idle_broker_cores": round(idle["broker"] / idle_s, 3),
            "idle_consumer_cores": round(idle_self / idle_s, 3),
        }
    finally:
        await consumer.stop()
        await producer.stop()


async def floor(
    settings: Settings, broker_pid: int, num_messages: int = 100, idle_s: float = 1.0
) -> dict[str, Any]:
    """The hop on a running stack's broker, at the fetch wait its services use: what
    ``bench.overhead`` puts beside the TTFT legs it measured in the same run."""
    await ensure_topics(settings, {TOPIC: 1})
    return await one_setting(
        settings,
        1,
        settings.consumer_fetch_wait_ms,
        num_messages,
        idle_s,
        broker_pid,
        lambda: None,
    )


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    settings = bench_settings()
    rows: list[dict[str, Any]] = []
    async with broker_only(settings, {TOPIC: args.partitions}) as stack:
        with progress(console) as bar:
            for wait_ms in args.fetch_wait_ms:
                task = bar.add_task(f"fetch_max_wait_ms={wait_ms}", total=args.messages)
                rows.append(
                    await one_setting(
                        settings,
                        args.partitions,
                        wait_ms,
                        args.messages,
                        args.idle_s,
                        stack.pid("broker"),
                        lambda t=task: bar.advance(t),
                        args.pause_ms,
                    )
                )
    return {"load_start": load_start, "load_end": uptime_load(), "results": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fetch-wait-ms", type=int, nargs="+", default=[5, 20, 100, 500])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument(
        "--pause-ms", type=float, default=50.0, help="mean pause before each message"
    )
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--partitions", type=int, default=1, help="assigned to the consumer")
    args = parser.parse_args()
    exit_on_sigterm()
    console = make_console()
    result = asyncio.run(measure(args, console))
    path = write_result("hop", result)
    table = Table(title="one loopback hop through tansu (produce acks=all --> consume)")
    for column in (
        "fetch_max_wait_ms",
        "hop p50 ms",
        "hop p99 ms",
        "idle broker cores",
        "idle consumer cores",
    ):
        table.add_column(column, justify="right")
    for row in result["results"]:
        table.add_row(
            str(row["fetch_max_wait_ms"]),
            f"{row['hop_ms']['p50']:.2f}",
            f"{row['hop_ms']['p99']:.2f}",
            f"{row['idle_broker_cores']:.3f}",
            f"{row['idle_consumer_cores']:.3f}",
        )
    console.print(table)
    loads = f"{result['load_start']['load_1_5_15']} -> {result['load_end']['load_1_5_15']}"
    console.print(f"[dim]load {loads}; wrote {path}[/]")


if __name__ == "__main__":
    main()
