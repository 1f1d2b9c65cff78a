"""Ingest throughput, topic --> ClickHouse, in this process: ``python -m bench.billing_sink``.

    .venvs/stream/bin/python -m bench.billing_sink [--events N] [--copies N] [--json PATH]

Produces N UsageEvents (a share of them twice, as redeliveries) to a fresh usage topic
on a bundled broker of its own (started by ``tokenbus_cli.stack.Stack``, as ``tokenbus
up`` starts it), then runs the real ``BillingSink`` in this process,
pinned to one core, on a fresh embedded ClickHouse (chdb) directory, until it has
written or skipped every record. Prints events per wall-clock second and per CPU second
of this process (all its threads, chdb's included: on a shared machine the core is not
all ours), and the seconds its ClickHouse lookups and inserts took; ``--json`` writes
the figures to a file.

The broker runs on the other cores (when there are any), so the core under test holds
exactly the sink: Kafka fetches and decoding, the key lookup, pricing and the insert,
with chdb's own threads. ``bench.billing_ingest`` measures ``python -m billing`` as a
process of its own; this one serves profiling the sink in-process (cProfile, yappi).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from billing.dedup import Stored
from billing.sink import BillingSink
from billing.storage import ClickHouseStore, StoredAttempts, UsageStore
from schemas import UsageEvent, UsageStatus, encode
from tokenbus.config import Settings
from tokenbus.cost import PeakHours
from tokenbus.kafka import make_producer
from tokenbus.price_file import load_price_book
from tokenbus.pricing import Pricer
from tokenbus.topics import Topics
from tokenbus_cli.stack import Stack, free_port


class TimedStore:
    """Wraps a UsageStore and adds up the seconds its lookups and inserts take."""

    def __init__(self, inner: ClickHouseStore) -> None:
        self.inner = inner
        self.seconds = {"lookup": 0.0, "insert": 0.0}

    def look_up(self, keys: Sequence[Any]) -> Stored:
        started = time.perf_counter()
        try:
            return self.inner.look_up(keys)
        finally:
            self.seconds["lookup"] += time.perf_counter() - started

    def recent_attempts(self, limit: int, window_s: float) -> StoredAttempts:
        started = time.perf_counter()
        try:
            return self.inner.recent_attempts(limit, window_s)
        finally:
            self.seconds["lookup"] += time.perf_counter() - started

    def insert_columns(self, columns: Sequence[Sequence[Any]], *, dedup_token: str) -> None:
        started = time.perf_counter()
        try:
            self.inner.insert_columns(columns, dedup_token=dedup_token)
        finally:
            self.seconds["insert"] += time.perf_counter() - started

    def query(self, sql: str, parameters: Any = None) -> list[dict[str, Any]]:
        return self.inner.query(sql, parameters)


def make_events(num_events: int, seed: int = 1) -> list[UsageEvent]:
    rng = random.Random(seed)
    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    statuses = [UsageStatus.OK] * 17 + [UsageStatus.FAILED, UsageStatus.CANCELLED]
    return [
        UsageEvent(
            request_id=f"req_{n:09d}",
            session_id=f"sess_{n // 25}",
            tenant_id=f"tenant-{n % 50}",
            model="tiny-llama",
            worker_id=f"worker-{n % 8}",
            priority=n % 3,
            status=rng.choice(statuses),
            num_prompt_tokens=rng.choice([rng.randint(20, 2000), rng.randint(2048, 16000)]),
            num_completion_tokens=rng.randint(1, 500),
            num_cached_tokens=rng.choice([0, 0, 128]),
            queue_ms=rng.uniform(0, 50),
            ttft_ms=rng.uniform(5, 300),
            total_ms=rng.uniform(300, 5000),
            precision="fp16",
            created_at=t0 + timedelta(milliseconds=10 * n),
            finished_at=t0 + timedelta(milliseconds=10 * n + 900),
        )
        for n in range(num_events)
    ]


async def produce_usage(
    settings: Settings,
    records: list[tuple[bytes, bytes]],
    *,
    linger_ms: int = 20,
    max_batch_size: int = 1 << 20,
) -> dict[int, int]:
    """Sends (key, value) records to the usage topic in order (batched per partition);
    returns partition --> end offset, from the acks."""
    producer = make_producer(settings, linger_ms=linger_ms, max_batch_size=max_batch_size)
    await producer.start()
    try:
        topic = Topics(settings.topic_prefix).usage
        pending = [await producer.send(topic, value, key=key) for key, value in records]
        acks = await asyncio.gather(*pending)
    finally:
        await producer.stop()
    ends: dict[int, int] = {}
    for ack in acks:
        ends[ack.partition] = max(ends.get(ack.partition, 0), ack.offset + 1)
    return ends


async def ingest(settings: Settings, store: UsageStore, ends: dict[int, int]) -> dict[str, float]:
    """Runs the sink until its commits reach ``ends``; returns seconds per phase."""
    pricer = Pricer(load_price_book(settings), PeakHours.parse(settings.peak_hours))
    sink = BillingSink(settings, store, pricer)
    target = sum(ends.values())
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(sink.run(stop))
    first_batch_at: float | None = None
    cpu_at_first_batch = time.process_time()
    while sink.num_inserted + sink.num_duplicates + sink.num_dead_letters < target:
        if task.done():
            task.result()
            raise RuntimeError("the sink stopped early")
        if first_batch_at is None and sink.num_batches:
            first_batch_at = time.perf_counter()
            cpu_at_first_batch = time.process_time()
        await asyncio.sleep(0.005)
    finished = time.perf_counter()
    cpu_seconds = time.process_time() - cpu_at_first_batch
    stop.set()
    await task
    return {
        "seconds_total": finished - started,
        "seconds_from_first_batch": finished - (first_batch_at or started),
        "cpu_seconds_from_first_batch": cpu_seconds,
        "num_inserted": sink.num_inserted,
        "num_duplicates": sink.num_duplicates,
        "num_batches": sink.num_batches,
    }


def pin_to_one_core() -> int:
    """Pins this process (and the threads it starts later) to its lowest allowed core."""
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return core


async def run(num_events: int, num_copies: int, batch_max_rows: int) -> dict[str, Any]:
    core = min(os.sched_getaffinity(0))
    home = Path(tempfile.mkdtemp(prefix="billing-bench-"))
    settings = Settings(
        home=home,
        kafka_port=free_port(),
        broker_profile="tansu",  # the bundled broker, with its workarounds
        topic_prefix="bench",
        num_partitions=4,
        clickhouse_dsn=f"chdb://{home}/clickhouse",
        billing_batch_max_rows=batch_max_rows,
    )
    stack = Stack(settings)
    try:
        await stack.start_broker()
        # The broker runs on the other cores (when there are any): the core under test
        # holds exactly the sink.
        others = os.sched_getaffinity(0) - {core}
        if others:
            os.sched_setaffinity(stack.pid("broker"), others)
        events = make_events(num_events)
        copies = random.Random(2).sample(events, num_copies)
        records = [(e.tenant_id.encode(), encode(e)) for e in [*events, *copies]]
        ends = await produce_usage(settings, records)
        pin_to_one_core()
        store = TimedStore(await asyncio.to_thread(ClickHouseStore, settings.clickhouse))
        try:
            result = await ingest(settings, store, ends)
        finally:
            store.inner.close()
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)
    num_records = len(records)
    return {
        "num_records": num_records,
        "num_events": num_events,
        "num_copies": num_copies,
        "batch_max_rows": batch_max_rows,
        "core": core,
        **result,
        "events_per_s": num_records / result["seconds_from_first_batch"],
        # On a shared machine the core is not all ours; CPU time is what it cost.
        "events_per_cpu_s": num_records / result["cpu_seconds_from_first_batch"],
        "seconds_lookup": store.seconds["lookup"],
        "seconds_insert": store.seconds["insert"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--copies", type=int, default=2_000, help="events sent twice")
    parser.add_argument("--batch-max-rows", type=int, default=50_000)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.events, args.copies, args.batch_max_rows))
    for key, value in result.items():
        print(f"{key:26s} {value:,.3f}" if isinstance(value, float) else f"{key:26s} {value:,}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
