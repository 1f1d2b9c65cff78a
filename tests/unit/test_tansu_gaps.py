"""The offset-gap rule of tokenbus.tansu.gaps: refetch a new gap until it has lasted settle_s."""

from __future__ import annotations

from typing import Any

from aiokafka.consumer.fetcher import PartitionRecords

from tests.unit.tansu_records import batch, partition_records
from tokenbus.tansu import gaps
from tokenbus.tansu.gaps import GapBook, refetching_unpack

# aiokafka's own unpacking, whatever an earlier test installed.
ORIGINAL_UNPACK = gaps.PATCH.original() if gaps.PATCH.on else PartitionRecords._unpack_records


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_gap_is_refetched_until_it_has_lasted_the_settle_time() -> None:
    clock = Clock()
    book = GapBook(settle_s=0.5, clock=clock)
    assert book.refetch("t", 0, 10)
    clock.now += 0.3
    assert book.refetch("t", 0, 10)
    clock.now += 0.3
    assert not book.refetch("t", 0, 10)  # still there after 0.6 s: a real gap
    assert book.refetch("t", 0, 10)  # forgotten once accepted: a new gap at 10 later


def test_gaps_are_told_apart_by_topic_partition_and_offset() -> None:
    clock = Clock()
    book = GapBook(settle_s=0.5, clock=clock)
    assert book.refetch("t", 0, 10)
    clock.now += 0.6
    assert book.refetch("t", 1, 10) and book.refetch("u", 0, 10) and book.refetch("t", 0, 11)
    assert not book.refetch("t", 0, 10)


# -- the refetching unpack, on record batches as a broker sends them ----------------------
def unpack_with(book: GapBook, prefix: str = "tokenbus.") -> Any:
    return refetching_unpack(ORIGINAL_UNPACK, book, prefix)


def read(records: Any, book: GapBook, prefix: str = "tokenbus.") -> list[int]:
    return [record.offset for record in unpack_with(book, prefix)(records)]


def test_records_without_a_gap_all_come_out() -> None:
    records = partition_records("tokenbus.usage", 10, batch(10, 3), batch(13, 2))
    assert read(records, GapBook(settle_s=5)) == [10, 11, 12, 13, 14]
    assert records.next_fetch_offset == 15


def test_a_new_gap_ends_the_result_at_the_gap_and_keeps_the_position_before_it() -> None:
    records = partition_records("tokenbus.usage", 10, batch(10, 2), batch(14, 2))
    assert read(records, GapBook(settle_s=5)) == [10, 11]
    assert records.next_fetch_offset == 12  # the next fetch asks for 12 again


def test_a_gap_at_the_fetch_offset_returns_nothing_until_it_settles() -> None:
    clock = Clock()
    book = GapBook(settle_s=0.5, clock=clock)
    assert read(partition_records("tokenbus.r", 10, batch(12, 1)), book) == []
    clock.now += 0.6
    records = partition_records("tokenbus.r", 10, batch(12, 1))
    assert read(records, book) == [12]  # lasted the settle time: accepted as real
    assert records.next_fetch_offset == 13


def test_a_gap_closed_by_the_refetch_loses_nothing() -> None:
    book = GapBook(settle_s=5)
    first = partition_records("tokenbus.r", 0, batch(0, 1), batch(2, 1))
    assert read(first, book) == [0]
    second = partition_records("tokenbus.r", first.next_fetch_offset, batch(1, 1), batch(2, 1))
    assert read(second, book) == [1, 2]


def test_topics_outside_the_prefix_are_not_watched() -> None:
    records = partition_records("tokenbus-dispatch-changelog", 0, batch(0, 1), batch(5, 1))
    assert read(records, GapBook(settle_s=5)) == [0, 5]


def test_offsets_a_transaction_marker_holds_are_no_gap() -> None:
    # A transactional producer's commit marker sits at offset 2: aiokafka skips it, and
    # the next record (3) is exactly where the log goes on. Never a refetch.
    book = GapBook(settle_s=5)
    records = partition_records(
        "tokenbus.usage", 0, batch(0, 2), batch(2, 1, control=True), batch(3, 2)
    )
    assert read(records, book) == [0, 1, 3, 4]
    assert records.next_fetch_offset == 5
    # The marker first in the fetch as well.
    records = partition_records("tokenbus.usage", 2, batch(2, 1, control=True), batch(3, 1))
    assert read(records, book) == [3]
