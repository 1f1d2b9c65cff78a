"""The span sink's gathering: one insert for what arrives within ``span_gather_s`` of the
first span batch, on a fake consumer whose batches arrive on a schedule."""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import TopicPartition

from billing.span_sink import FETCH_WAIT_S, GATHER_RECORDS, SpanSink
from tokenbus.config import Settings
from tokenbus.retry import Backoff

P0 = TopicPartition("t.spans", 0)
P1 = TopicPartition("t.spans", 1)


@dataclass
class Record:
    offset: int
    value: bytes


class ScheduledConsumer:
    """Hands out each record once its arrival (seconds after the first fetch) has passed,
    waiting up to ``timeout_ms`` for the next, as aiokafka's ``getmany`` does."""

    def __init__(self, arrivals: list[tuple[float, TopicPartition]]) -> None:
        self.arrivals = sorted(arrivals, key=lambda a: a[0])
        self.num_taken = 0
        self.started: float | None = None

    async def getmany(self, timeout_ms: int = 0, max_records: int = 0) -> dict[Any, list[Any]]:
        loop = asyncio.get_running_loop()
        if self.started is None:
            self.started = loop.time()
        deadline = loop.time() + timeout_ms / 1000
        fetched: dict[Any, list[Any]] = {}
        while not fetched and loop.time() < deadline:
            due = [a for a in self.arrivals if self.started + a[0] <= loop.time()]
            for _, tp in due[:max_records]:
                fetched.setdefault(tp, []).append(Record(self.num_taken, b"{}"))
                self.num_taken += 1
                self.arrivals.remove((_, tp))
            if not fetched:
                await asyncio.sleep(0.005)
        return fetched


def sink(tmp_path: Path, gather_s: float) -> SpanSink:
    return SpanSink(Settings(home=tmp_path, span_gather_s=gather_s), store=None)  # type: ignore[arg-type]


def sizes(batch: dict[Any, list[Any]]) -> dict[Any, int]:
    return {tp: len(records) for tp, records in batch.items()}


async def test_what_arrives_within_the_gather_goes_into_one_insert(tmp_path: Path) -> None:
    consumer = ScheduledConsumer([(0.0, P0), (0.1, P1), (0.15, P0), (0.8, P0)])
    span_sink, stop = sink(tmp_path, gather_s=0.4), asyncio.Event()
    assert sizes(await span_sink._gather(consumer, stop)) == {P0: 2, P1: 1}
    # the fourth arrives after the window closed: the next insert's
    assert sizes(await span_sink._gather(consumer, stop)) == {P0: 1}


async def test_a_longer_gather_makes_fewer_inserts(tmp_path: Path) -> None:
    consumer = ScheduledConsumer([(0.0, P0), (0.1, P1), (0.15, P0), (0.8, P0)])
    span_sink, stop = sink(tmp_path, gather_s=1.2), asyncio.Event()
    assert sizes(await span_sink._gather(consumer, stop)) == {P0: 3, P1: 1}


async def test_the_gather_ends_at_its_record_limit(tmp_path: Path) -> None:
    consumer = ScheduledConsumer([(0.0, P0)] * (GATHER_RECORDS + 5))
    span_sink, stop = sink(tmp_path, gather_s=30.0), asyncio.Event()
    gathered = await asyncio.wait_for(span_sink._gather(consumer, stop), timeout=5)
    assert sizes(gathered) == {P0: GATHER_RECORDS}


async def test_stop_ends_a_long_gather_within_a_fetch_wait(tmp_path: Path) -> None:
    consumer = ScheduledConsumer([(0.0, P0), (0.1, P0)])
    span_sink, stop = sink(tmp_path, gather_s=30.0), asyncio.Event()
    gathering = asyncio.create_task(span_sink._gather(consumer, stop))
    await asyncio.sleep(0.3)
    stop.set()
    # seen at the next fetch (FETCH_WAIT_S), not at the window's end
    assert sizes(await asyncio.wait_for(gathering, timeout=2 * FETCH_WAIT_S)) == {P0: 2}


class FlakyPublish:
    """A dead-letter producer that fails its first ``num_failures`` sends."""

    def __init__(self, num_failures: int) -> None:
        self.num_failures = num_failures
        self.sent: list[tuple[str, bytes]] = []

    async def __call__(
        self, topic: str, key: bytes, value: bytes, headers: Sequence[Any] | None = None
    ) -> None:
        if self.num_failures:
            self.num_failures -= 1
            raise KafkaConnectionError("the broker is away")
        self.sent.append((topic, value))


def retrying_sink(tmp_path: Path, backoff: Backoff) -> SpanSink:
    return SpanSink(Settings(home=tmp_path), store=None, backoff=backoff)  # type: ignore[arg-type]


def unreadable(offset: int) -> SimpleNamespace:
    return SimpleNamespace(topic="t.spans", partition=0, offset=offset, key=b"acme", value=b"{")


async def test_a_failed_dead_letter_is_retried_not_raised(tmp_path: Path) -> None:
    span_sink = retrying_sink(tmp_path, Backoff(initial_s=0.001, max_s=0.001))
    publish, stop = FlakyPublish(num_failures=2), asyncio.Event()
    # raised, the error ended the span sink and, through billing's gather, the usage sink
    rows = await asyncio.wait_for(span_sink._rows([unreadable(7)], publish, stop), timeout=5)
    assert rows == []
    assert [topic for topic, _ in publish.sent] == ["tokenbus.dlq"]
    assert span_sink.num_refused == 1


async def test_a_stop_during_a_failing_dead_letter_writes_nothing(tmp_path: Path) -> None:
    span_sink = retrying_sink(tmp_path, Backoff(initial_s=30.0))
    publish, stop = FlakyPublish(num_failures=1), asyncio.Event()
    rows = asyncio.create_task(span_sink._rows([unreadable(7)], publish, stop))
    await asyncio.sleep(0.05)
    stop.set()
    assert await asyncio.wait_for(rows, timeout=5) is None  # uncommitted: redelivered
    assert publish.sent == []
