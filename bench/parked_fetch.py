"""When the bundled broker answers a parked fetch: the times it looks for new records.

A fetch with a wait of ``W`` ms goes to an idle partition at t = 0 (one raw aiokafka
``FetchRequest``, nothing else in flight), one record is produced at t = X, and the fetch's
answer is timed, for X from 0 to W + 1 ms. On Apache Kafka the answer follows the record
at once, whatever X. On tansu it comes at the broker's next look: the answer times over
the sweep are its look schedule, and a request's hop waits from the record's arrival to
the next look of the consumer's fetch (``bench.hop``'s hop is that wait for records
that come at random).

    .venvs/stream/bin/python -m bench.parked_fetch --fetch-wait-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.fetch import FetchRequest
from rich.console import Console
from rich.table import Table

from bench.common import at_least_one, bench_settings, progress, progress_task, run_benchmark
from bench.report import uptime_load
from bench.services import broker_only
from bench.stats import summarize
from tokenbus.config import Settings
from tokenbus.kafka import make_producer

TOPIC = "bench.parked_fetch"
MAX_BYTES = 1 << 20


def sweep_rows(answers: dict[int, list[float | None]]) -> list[dict[str, Any]]:
    """The sweep's answers (``X``, ms the record was produced at --> each fetch's answer
    time, ms, or None where it ended without the record) as one row per X: the median
    answer of the fetches that brought the record, how long after X that is (the record's
    wait, the produce's round trip in it), and how many ended without it. Answers that
    stay put while X moves are one look of the broker's; a wait that stays put as X moves
    means answers on arrival. Pure."""
    rows: list[dict[str, Any]] = []
    for at_ms in sorted(answers):
        brought = [a for a in answers[at_ms] if a is not None]
        answer_ms = statistics.median(brought) if brought else None
        rows.append(
            {
                "record_at_ms": at_ms,
                "answer_ms": None if answer_ms is None else round(answer_ms, 2),
                "waited_ms": None if answer_ms is None else round(answer_ms - at_ms, 2),
                "ended_without_it": len(answers[at_ms]) - len(brought),
            }
        )
    return rows


async def sweep(
    settings: Settings, wait_ms: int, repeats: int, done: Callable[[int], None]
) -> dict[int, list[float | None]]:
    """X --> the answer times, ms, of ``repeats`` fetches parked at ``wait_ms`` with a
    record produced X ms after each was sent (None: the fetch ended without it);
    ``done`` is told how many fetches are done."""
    producer = make_producer(settings, linger_ms=0)
    client = AIOKafkaClient(bootstrap_servers=settings.bootstrap)
    await producer.start()
    await client.bootstrap()
    try:
        node = next(iter(client.cluster.brokers())).nodeId
        first = offset = (await producer.send_and_wait(TOPIC, b"start")).offset + 1
        answers: dict[int, list[float | None]] = {}
        for _ in range(repeats):
            for at_ms in range(wait_ms + 2):
                answer = await parked_fetch(client, node, producer, wait_ms, offset, at_ms)
                answers.setdefault(at_ms, []).append(answer)
                offset += 1
                done(offset - first)
        return answers
    finally:
        await client.close()
        await producer.stop()


async def parked_fetch(
    client: AIOKafkaClient,
    node: int,
    producer: AIOKafkaProducer,
    wait_ms: int,
    offset: int,
    at_ms: int,
) -> float | None:
    """One fetch from ``offset`` parked at ``wait_ms``, the record at ``offset`` produced
    ``at_ms`` after it was sent: when the fetch answered (ms), or None if it ended
    without the record."""
    fetch = FetchRequest(wait_ms, 1, MAX_BYTES, 0, [(TOPIC, [(0, offset, MAX_BYTES)])])
    sent = time.perf_counter()
    answered: list[float] = []
    answer = asyncio.ensure_future(client.send(node, fetch))
    answer.add_done_callback(lambda _: answered.append(time.perf_counter()))
    await asyncio.sleep(at_ms / 1000)
    await producer.send_and_wait(TOPIC, b"x")
    response = await answer
    partition = response.topics[0][1][0]  # (index, error, high water, ..., records)
    await asyncio.sleep(0.005)  # the broker idle again before the next fetch
    if not partition[-1]:  # no records: the fetch ended before the record came
        return None
    return (answered[0] - sent) * 1000


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    settings = bench_settings()
    rows: list[dict[str, Any]] = []
    async with broker_only(settings, {TOPIC: 1}):
        with progress(console) as bar:
            for wait_ms in args.fetch_wait_ms:
                total = args.repeats * (wait_ms + 2)
                done = progress_task(bar, f"wait {wait_ms} ms", total)
                answers = await sweep(settings, wait_ms, args.repeats, done)
                swept = sweep_rows(answers)
                waited = [r["waited_ms"] for r in swept if r["waited_ms"] is not None]
                rows.append(
                    {"fetch_max_wait_ms": wait_ms, "sweep": swept, "waited_ms": summarize(waited)}
                )
    return {"load_start": load_start, "load_end": uptime_load(), "results": rows}


def render(result: dict[str, Any], console: Console) -> None:
    for row in result["results"]:
        table = Table(title=f"a fetch parked at {row['fetch_max_wait_ms']} ms")
        for column in (
            "record produced at, ms",
            "fetch answered at, ms",
            "the record waited, ms",
            "fetches that ended without it",
        ):
            table.add_column(column, justify="right")
        for r in row["sweep"]:
            brought = r["answer_ms"] is not None
            table.add_row(
                str(r["record_at_ms"]),
                f"{r['answer_ms']:.1f}" if brought else "-",
                f"{r['waited_ms']:.1f}" if brought else "-",
                str(r["ended_without_it"]),
            )
        console.print(table)
        waited = row["waited_ms"]
        console.print(
            f"a record's wait over the sweep: median {waited['p50']:.1f} ms, "
            f"max {waited['max']:.1f} ms"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    # tansu never answers a fetch parked at 0 ms, and a sweep of no fetches shows nothing.
    parser.add_argument("--fetch-wait-ms", type=at_least_one, nargs="+", default=[20])
    parser.add_argument("--repeats", type=at_least_one, default=5, help="fetches for each X")
    parser.add_argument("--name", default="parked_fetch")
    run_benchmark(parser, argv, measure, render)


if __name__ == "__main__":
    main()
