from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndTimestamp

from tokenbus.chunks import Chunk, ChunkBatch, encode_batch
from tokenbus.config import Settings
from tokenbus.replies import CLOCK_SKEW, KafkaReplyLog, Scan, Wanted, waiting_on
from tokenbus.topics import reply_batch_key


def chunk(request_id: str, seq: int, tenant: str = "t") -> Chunk:
    return Chunk(request_id=request_id, tenant_id=tenant, seq=seq, text=f"{request_id}/{seq}")


def batch(*chunks: Chunk) -> ChunkBatch:
    return ChunkBatch(tenant_id=chunks[0].tenant_id, chunks=list(chunks))


T = reply_batch_key("t")


def test_a_scan_gives_each_read_its_own_requests_chunks_in_the_topics_order() -> None:
    r1, r2 = Wanted("topic", "t", "r1", 1_000), Wanted("topic", "t", "r2", 1_000)
    scan = Scan([r1, r2], stop_ms=9_000)
    scan.add(1_100, T, batch(chunk("r1", 0), chunk("r2", 0), chunk("r3", 0)))
    scan.add(1_200, T, batch(chunk("r2", 1)))
    scan.add(1_300, T, batch(chunk("r2", 2), chunk("r1", 1)))
    assert scan.chunks(r1) == [chunk("r1", 0), chunk("r1", 1)]
    assert scan.chunks(r2) == [chunk("r2", 0), chunk("r2", 1), chunk("r2", 2)]


def test_a_scan_starts_at_its_earliest_read_and_each_read_keeps_its_own_window() -> None:
    # The same request id twice on one topic: the later read must not take the
    # earlier request's chunks, although the scan reads them for the earlier read.
    early, late = Wanted("topic", "t", "r1", 1_000), Wanted("topic", "t", "r1", 2_000)
    scan = Scan([late, early], stop_ms=5_000)
    assert scan.start_ms == 1_000 and scan.stop_ms == 5_000
    scan.add(999, T, batch(chunk("r1", 7)))
    scan.add(1_500, T, batch(chunk("r1", 0)))
    scan.add(2_000, T, batch(chunk("r1", 1)))
    scan.add(5_000, T, batch(chunk("r1", 2)))  # newer than the scan
    assert scan.chunks(early) == [chunk("r1", 0), chunk("r1", 1)]
    assert scan.chunks(late) == [chunk("r1", 1)]


def test_a_scan_reads_only_the_wanted_tenants_records_under_their_own_key() -> None:
    mine, theirs = Wanted("topic", "t", "r1", 0), Wanted("topic", "u", "r1", 0)
    scan = Scan([mine, theirs], stop_ms=9_000)
    assert scan.keys == {reply_batch_key("t"), reply_batch_key("u")}
    scan.add(1, reply_batch_key("u"), batch(chunk("r1", 0, tenant="t")))  # wrong key
    scan.add(2, T, batch(chunk("r1", 1, tenant="t")))
    scan.add(3, reply_batch_key("u"), batch(chunk("r1", 5, tenant="u")))
    assert scan.chunks(mine) == [chunk("r1", 1)]
    assert scan.chunks(theirs) == [chunk("r1", 5, tenant="u")]


async def test_waiting_on_takes_the_topics_unanswered_reads_in_order() -> None:
    loop = asyncio.get_running_loop()
    a, b, c, d = (Wanted(t, "t", r, 0) for t, r in [("x", "a"), ("y", "b"), ("x", "c"), ("x", "d")])
    pending = {w: loop.create_future() for w in (a, b, c, d)}
    pending[c].set_result([])
    assert waiting_on(pending, "x") == [a, d]
    assert waiting_on(pending, "z") == []


# -- the shell, on a consumer that serves a list of records ---------------------------


@dataclass
class Record:
    timestamp: int
    key: bytes
    value: bytes


class Consumer:
    """One partition of records; counts scans (an ``assign`` starts each)."""

    def __init__(self, records: list[Record], fail: Exception | None = None) -> None:
        self.records = records
        self.fail = fail
        self.num_scans = 0
        self.position = 0
        self.fetched = asyncio.Event()

    async def topics(self) -> set[str]:
        await asyncio.sleep(0.01)  # a metadata round trip: reads made meanwhile join
        return set()

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    def assign(self, tps: list[TopicPartition]) -> None:
        self.num_scans += 1

    async def offsets_for_times(
        self, times: dict[TopicPartition, int]
    ) -> dict[TopicPartition, OffsetAndTimestamp | None]:
        found: dict[TopicPartition, OffsetAndTimestamp | None] = {}
        for tp, ms in times.items():
            offsets = [n for n, r in enumerate(self.records) if r.timestamp >= ms]
            found[tp] = OffsetAndTimestamp(offsets[0], ms) if offsets else None
        return found

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.position = offset

    async def getmany(
        self, tp: TopicPartition, timeout_ms: int
    ) -> dict[TopicPartition, list[Record]]:
        self.fetched.set()
        await asyncio.sleep(0.001)
        if self.fail is not None:
            raise self.fail
        records = self.records[self.position : self.position + 2]
        self.position += len(records)
        return {tp: records} if records else {}

    async def stop(self) -> None:
        pass


def now_ms(ago_s: float) -> int:
    return int((time.time() - ago_s) * 1000)


def reply_log(tmp_path: Path, consumer: Consumer) -> KafkaReplyLog:
    log = KafkaReplyLog(Settings(home=tmp_path))
    log._consumer = consumer
    return log


def topic_of(*ids: str) -> list[Record]:
    return [
        Record(now_ms(3), T, encode_batch("t", [chunk(rid, seq) for rid in ids]))
        for seq in range(3)
    ]


SINCE = datetime.now(UTC) - timedelta(seconds=10)


async def test_concurrent_reads_of_one_topic_are_answered_by_one_scan(tmp_path: Path) -> None:
    consumer = Consumer(topic_of("r0", "r1", "r2", "r3"))
    log = reply_log(tmp_path, consumer)
    found = await asyncio.gather(
        *(log.read(reply_to="x", tenant_id="t", request_id=f"r{n}", since=SINCE) for n in range(4))
    )
    assert consumer.num_scans == 1
    assert found == [[chunk(f"r{n}", seq) for seq in range(3)] for n in range(4)]
    assert log._pending == {}


async def test_reads_of_another_topic_wait_for_a_scan_of_their_own(tmp_path: Path) -> None:
    consumer = Consumer(topic_of("r0"))
    log = reply_log(tmp_path, consumer)
    reads = [
        log.read(reply_to=topic, tenant_id="t", request_id="r0", since=SINCE)
        for topic in ("x", "y", "x", "y")
    ]
    found = await asyncio.gather(*reads)
    assert consumer.num_scans == 2
    assert all(chunks == [chunk("r0", seq) for seq in range(3)] for chunks in found)


async def test_a_read_sees_nothing_older_than_its_request(tmp_path: Path) -> None:
    consumer = Consumer(topic_of("r0"))  # written 3 s ago
    log = reply_log(tmp_path, consumer)
    recent = datetime.now(UTC) + CLOCK_SKEW - timedelta(seconds=1)
    old, new = await asyncio.gather(
        log.read(reply_to="x", tenant_id="t", request_id="r0", since=SINCE),
        log.read(reply_to="x", tenant_id="t", request_id="r0", since=recent),
    )
    assert consumer.num_scans == 1
    assert old == [chunk("r0", seq) for seq in range(3)] and new == []


async def test_a_failed_scan_fails_every_read_it_answered(tmp_path: Path) -> None:
    consumer = Consumer(topic_of("r0", "r1"), fail=OSError("broker gone"))
    log = reply_log(tmp_path, consumer)
    found = await asyncio.gather(
        *(log.read(reply_to="x", tenant_id="t", request_id=f"r{n}", since=SINCE) for n in range(3)),
        return_exceptions=True,
    )
    assert consumer.num_scans == 1
    assert all(isinstance(f, OSError) and str(f) == "broker gone" for f in found)
    consumer.fail = None
    again = await log.read(reply_to="x", tenant_id="t", request_id="r1", since=SINCE)
    assert again == [chunk("r1", seq) for seq in range(3)] and log._pending == {}


async def test_reads_whose_scan_was_cancelled_are_scanned_for_again(tmp_path: Path) -> None:
    consumer = Consumer(topic_of("r0", "r1", "r2"))
    log = reply_log(tmp_path, consumer)
    leader = asyncio.create_task(
        log.read(reply_to="x", tenant_id="t", request_id="r0", since=SINCE)
    )
    await asyncio.sleep(0)  # the leader holds the consumer
    followers = [
        asyncio.create_task(log.read(reply_to="x", tenant_id="t", request_id=rid, since=SINCE))
        for rid in ("r1", "r2")
    ]
    await asyncio.wait_for(consumer.fetched.wait(), timeout=5)  # the scan has begun
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    found = await asyncio.wait_for(asyncio.gather(*followers), timeout=5)
    assert consumer.num_scans == 2
    assert found == [[chunk(rid, seq) for seq in range(3)] for rid in ("r1", "r2")]
    assert log._pending == {}
