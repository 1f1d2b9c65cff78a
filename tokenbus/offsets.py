"""Which offset is safe to commit when records finish out of order.

A consumer that works on many records at once may only commit up to the first record
that is still in progress; committing past it would lose that record on a crash.
"""

from __future__ import annotations


class OffsetTracker:
    """Per partition: the offsets started and not yet done."""

    def __init__(self) -> None:
        self._pending: dict[int, set[int]] = {}
        self._next: dict[int, int] = {}  # one past the highest offset started

    def start(self, partition: int, offset: int) -> None:
        self._pending.setdefault(partition, set()).add(offset)
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def done(self, partition: int, offset: int) -> None:
        self._pending.get(partition, set()).discard(offset)

    def committable(self) -> dict[int, int]:
        """Partition -> the offset to commit (Kafka's 'next offset to read')."""
        result: dict[int, int] = {}
        for partition, upto in self._next.items():
            pending = self._pending.get(partition)
            result[partition] = min(pending) if pending else upto
        return result

    @property
    def num_pending(self) -> int:
        return sum(len(p) for p in self._pending.values())
