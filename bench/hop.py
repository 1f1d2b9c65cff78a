"""The physical floor: one loopback produce --> consume hop through the bundled broker,
and what an idle consumer costs, for several ``fetch_max_wait_ms``.

Every hop of a request goes from one process to another, and its consumer is waiting
in a parked fetch when the record is written, so the hop reported (``hop_ms``) has its
producer in a child process (``bench.hop_producer``) that never waits for the consumer.
The old measure is kept beside it (``hop_in_process_ms``): producer and consumer in this
one process in lock-step, each record sent only once the one before it was read. The
bundled broker answers that loop in 2 to 4 ms at any fetch wait, and a request's hops
at about a quarter of the wait (p50) and half of it (p99).

    .venvs/stream/bin/python -m bench.hop
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from rich.console import Console
from rich.table import Table

from bench.common import bench_settings, exit_on_sigterm, make_console, progress
from bench.hop_producer import sent_at_ns
from bench.procstat import CpuMeter
from bench.report import uptime_load, write_result
from bench.services import broker_only
from bench.stats import summarize
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, make_consumer, make_producer
from tokenbus_cli.stack import REPO_ROOT, settings_env

TOPIC = "bench.hop"


async def lock_step_hops(
    producer: AIOKafkaProducer,
    consumer: AIOKafkaConsumer,
    num_messages: int,
    pause_ms: float,
    on_step: Any,
) -> list[float]:
    """Producer and consumer in this process, on one event loop, in lock-step: each
    record is sent after a pause that follows the arrival of the one before, and timed
    from before its send to its arrival."""
    hops: list[float] = []
    for i in range(num_messages):
        sent = time.perf_counter()
        await producer.send_and_wait(TOPIC, str(i).encode(), partition=0)
        while True:
            # tansu never answers a fetch with fetch_max_wait_ms=0: bound the wait.
            record = await asyncio.wait_for(consumer.getone(), timeout=10)
            if record.value == str(i).encode():
                break
        hops.append(time.perf_counter() - sent)
        on_step()
        # A pause between messages, as a quiet topic sees them. tansu answers this
        # loop in 2 to 4 ms at any fetch wait, unlike a consumer's parked fetch
        # (``cross_process_hops``).
        await asyncio.sleep(pause_ms / 1000 * (0.5 + random.random()))
    return hops


async def cross_process_hops(
    settings: Settings,
    consumer: AIOKafkaConsumer,
    num_messages: int,
    pause_ms: float,
    on_step: Any,
) -> list[float]:
    """The producer in a process of its own (``bench.hop_producer``), as every hop of a
    request is: from the producer's clock before its send to this consumer's receipt,
    both read from CLOCK_MONOTONIC."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.hop_producer",
        "--topic",
        TOPIC,
        "--messages",
        str(num_messages),
        "--pause-ms",
        str(pause_ms),
        stdin=asyncio.subprocess.PIPE,
        env=settings_env(settings),
        cwd=REPO_ROOT,
    )
    assert child.stdin is not None
    try:
        child.stdin.write(b"go\n")  # the producer starts once it is connected
        await child.stdin.drain()
        hops: list[float] = []
        while len(hops) < num_messages:
            record = await asyncio.wait_for(consumer.getone(), timeout=30)
            received = time.monotonic_ns()
            sent = sent_at_ns(record.value or b"")
            if sent is not None:
                hops.append((received - sent) / 1e9)
                on_step()
        if await child.wait() != 0:
            raise RuntimeError(f"bench.hop_producer exited with {child.returncode}")
        return hops
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


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
        started = time.perf_counter()
        await producer.send_and_wait(TOPIC, b"first", partition=0)
        first_ack = time.perf_counter() - started
        while (await asyncio.wait_for(consumer.getone(), timeout=10)).value != b"first":
            pass  # past the first record (its send connects the producer), to the timed ones
        lock_step = await lock_step_hops(producer, consumer, num_messages, pause_ms, on_step)
        cross_process = await cross_process_hops(
            settings, consumer, num_messages, pause_ms, on_step
        )
        return {
            "fetch_max_wait_ms": wait_ms,
            "num_partitions": num_partitions,
            "pause_ms": pause_ms,
            # The floor of a request's hops: each is from one process to another.
            "hop_ms": summarize(cross_process, 1000),
            "hop_in_process_ms": summarize(lock_step, 1000),  # the lock-step loop
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
                task = bar.add_task(f"fetch_max_wait_ms={wait_ms}", total=2 * args.messages)
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
        "lock-step, one process: hop p50 ms",
        "idle broker cores",
        "idle consumer cores",
    ):
        table.add_column(column, justify="right")
    for row in result["results"]:
        table.add_row(
            str(row["fetch_max_wait_ms"]),
            f"{row['hop_ms']['p50']:.2f}",
            f"{row['hop_ms']['p99']:.2f}",
            f"{row['hop_in_process_ms']['p50']:.2f}",
            f"{row['idle_broker_cores']:.3f}",
            f"{row['idle_consumer_cores']:.3f}",
        )
    console.print(table)
    loads = f"{result['load_start']['load_1_5_15']} -> {result['load_end']['load_1_5_15']}"
    console.print(f"[dim]load {loads}; wrote {path}[/]")


if __name__ == "__main__":
    main()
