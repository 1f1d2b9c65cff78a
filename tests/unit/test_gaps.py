"""The offset-gap rule of tokenbus.gaps: refetch a new gap until it has lasted settle_s."""

from __future__ import annotations

from tokenbus.gaps import GapBook


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
