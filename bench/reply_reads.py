"""What N concurrent read-backs of one reply topic cost (``tokenbus.replies``).

    .venvs/stream/bin/python -m bench.reply_reads [--reads 44] [--steps 32] [--rounds 3]

A lost worker makes the dispatcher read back every request it held, at once, and the
requests of a batch (or of one SSE bridge) share one reply topic. On the bundled broker,
a reply topic is filled as a worker fills it: one record per engine step, holding one
chunk of each of up to ``--per-record`` requests, for ``--reads`` requests over
``--steps`` steps, plus a record of another tenant each step. Then, per round, one
``KafkaReplyLog`` (made fresh, as after a start) answers ``--reads`` concurrent
``read()`` calls, each for its own request; a single read is timed before them, for
scale. Each read must get exactly its own request's chunks, all of them.

Reported per round: the wall time until the last of the concurrent reads returned, and
this process's CPU (the reads' decoding and the consumer; the broker is another
process, its CPU is reported beside).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from datetime import UTC, datetime
from typing import Any

from bench.common import bench_settings, exit_on_sigterm, print_table
from bench.procstat import cpu_seconds
from bench.report import uptime_load, write_result
from bench.services import broker_only
from schemas import FinishReason
from tokenbus.chunks import Chunk, encode_batch
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, make_producer
from tokenbus.replies import KafkaReplyLog
from tokenbus.topics import Topics, reply_batch_key

TENANT = "tenant-bench"
OTHER_TENANT = "tenant-other"


def request_ids(num_reads: int) -> list[str]:
    return [f"line-{n:04d}" for n in range(num_reads)]


async def fill(settings: Settings, topic: str, args: argparse.Namespace) -> int:
    """Writes the reply records as a worker would; returns how many."""
    ids = request_ids(args.reads)
    groups = [ids[i : i + args.per_record] for i in range(0, len(ids), args.per_record)]
    producer = make_producer(settings)
    await producer.start()
    num_records = 0
    try:
        for step in range(args.steps):
            last = step == args.steps - 1
            for group in groups:
                chunks = [
                    Chunk(
                        request_id=rid,
                        tenant_id=TENANT,
                        seq=step,
                        text="x",
                        token_ids=[step],
                        num_tokens=1,
                        finish_reason=FinishReason.LENGTH if last else None,
                    )
                    for rid in group
                ]
                await producer.send_and_wait(
                    topic, encode_batch(TENANT, chunks), key=reply_batch_key(TENANT)
                )
                num_records += 1
            other = [Chunk(request_id=ids[0], tenant_id=OTHER_TENANT, seq=step, text="y")]
            await producer.send_and_wait(
                topic, encode_batch(OTHER_TENANT, other), key=reply_batch_key(OTHER_TENANT)
            )
            num_records += 1
    finally:
        await producer.stop()
    return num_records


def check(request_id: str, chunks: list[Chunk], steps: int) -> None:
    """Exactly the request's own chunks, every step once."""
    if sorted(c.seq for c in chunks) != list(range(steps)):
        raise AssertionError(f"{request_id}: read back seqs {sorted(c.seq for c in chunks)}")
    if any(c.request_id != request_id or c.tenant_id != TENANT for c in chunks):
        raise AssertionError(f"{request_id}: read back another request's chunks")


async def one_round(
    settings: Settings, topic: str, since: datetime, args: argparse.Namespace, broker_pid: int
) -> dict[str, Any]:
    log = KafkaReplyLog(settings)
    try:
        started = time.monotonic()
        single = await log.read(
            reply_to=topic, tenant_id=TENANT, request_id=request_ids(1)[0], since=since
        )
        single_s = time.monotonic() - started
        check(request_ids(1)[0], single, args.steps)

        ids = request_ids(args.reads)
        cpu0, broker0 = cpu_seconds(os.getpid()), cpu_seconds(broker_pid)
        started = time.monotonic()
        results = await asyncio.gather(
            *(
                log.read(reply_to=topic, tenant_id=TENANT, request_id=rid, since=since)
                for rid in ids
            )
        )
        concurrent_s = time.monotonic() - started
        cpu_s = cpu_seconds(os.getpid()) - cpu0
        broker_cpu_s = cpu_seconds(broker_pid) - broker0
        for rid, chunks in zip(ids, results, strict=True):
            check(rid, chunks, args.steps)
    finally:
        await log.stop()
    return {
        "single_read_s": round(single_s, 3),
        "concurrent_reads_s": round(concurrent_s, 3),
        "reads_per_single": round(concurrent_s / single_s, 2),
        "cpu_s": round(cpu_s, 3),
        "broker_cpu_s": round(broker_cpu_s, 3),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    load_start = uptime_load()
    settings = bench_settings()
    rounds: list[dict[str, Any]] = []
    async with broker_only(settings) as stack:
        topic = Topics(settings.topic_prefix).batch_replies(TENANT, "bench")
        await ensure_topics(settings, {topic: 1})
        since = datetime.now(UTC)
        num_records = await fill(settings, topic, args)
        broker_pid = next(s.process.pid for s in stack.services if s.name == "broker")
        for _ in range(args.rounds):
            rounds.append(await one_round(settings, topic, since, args, broker_pid))
    median = {
        name: round(statistics.median(r[name] for r in rounds), 3)
        for name in ("single_read_s", "concurrent_reads_s", "cpu_s", "broker_cpu_s")
    }
    return {
        "load_start": load_start,
        "load_end": uptime_load(),
        "parameters": {
            "reads": args.reads,
            "steps": args.steps,
            "per_record": args.per_record,
            "rounds": args.rounds,
            "num_records": num_records,
            "fetch_max_wait_ms": settings.consumer_fetch_wait_ms,
        },
        "results": rounds,
        "median": median,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reads", type=int, default=44, help="concurrent reads, one per id")
    parser.add_argument("--steps", type=int, default=32, help="chunks per request")
    parser.add_argument("--per-record", type=int, default=8, help="requests per record")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    exit_on_sigterm()
    result = asyncio.run(measure(args))
    path = write_result("reply_reads", result)
    params = result["parameters"]
    print_table(
        f"{params['reads']} concurrent reads of one reply topic of "
        f"{params['num_records']} records (tansu)",
        ["round", "one read s", f"{params['reads']} reads s", "ratio", "CPU s", "broker CPU s"],
        (
            [
                n,
                r["single_read_s"],
                r["concurrent_reads_s"],
                r["reads_per_single"],
                r["cpu_s"],
                r["broker_cpu_s"],
            ]
            for n, r in enumerate(result["results"], 1)
        ),
        path,
    )


if __name__ == "__main__":
    main()
