from __future__ import annotations

from tokenbus.offsets import OffsetTracker


def test_commits_only_below_the_first_unfinished_offset() -> None:
    tracker = OffsetTracker()
    for offset in (10, 11, 12):
        tracker.start(0, offset)
    tracker.done(0, 12)
    tracker.done(0, 10)
    assert tracker.committable() == {0: 11}
    tracker.done(0, 11)
    assert tracker.committable() == {0: 13}
    assert tracker.num_pending == 0


def test_partitions_are_independent() -> None:
    tracker = OffsetTracker()
    tracker.start(0, 5)
    tracker.start(1, 7)
    tracker.done(1, 7)
    assert tracker.committable() == {0: 5, 1: 8}
