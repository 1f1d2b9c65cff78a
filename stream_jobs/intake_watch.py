"""Says so when the job stops reading a request partition it is behind on.

# each partition's offsets, every few seconds --> IntakeWatch --> the partitions stuck

A request partition is stuck when its high-water mark is beyond what the job's stream
has read, and what it has read has not moved for ``stall_s``. No other warning covers
it: the dispatcher's says requests wait in the job, and the tansu fetch rule's says
fetches come back empty; records the job never takes are in neither. The warning gives
the three readings that tell which layer holds the records: the consumer's position
behind the high-water mark (the broker answers nothing), records fetched and held by
the consumer (the stream does not ask for them), or the position at the high-water mark
with the stream's read offset behind (fetched, then dropped before the stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PartitionIntake:
    """Where one partition stands. Offsets are ``None`` while unknown."""

    topic: str
    partition: int
    read: int | None
    """The offset the stream took last (or, after a seek, the next it takes)."""
    position: int | None
    """The consumer's fetch position: the next offset it asks the broker for."""
    highwater: int | None
    """The broker's high-water mark, from the last fetch answered."""
    held: bool = False
    """Records fetched and held by the consumer, not taken by the stream yet."""
    paused: bool = False
    """The stream does not take this partition's records (Faust paused it)."""

    def describe(self) -> str:
        return (
            f"{self.topic}[{self.partition}] read {self.read} position {self.position}"
            f" high-water {self.highwater}{' held' if self.held else ''}"
            f"{' paused' if self.paused else ''}"
        )


class IntakeWatch:
    """The partitions behind whose read offset stood still for ``stall_s``, each told
    once per ``stall_s`` while it stays so. Pure."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stall_s = stall_s
        self._clock = clock
        self._since: dict[tuple[str, int], tuple[int | None, float]] = {}
        self._said: dict[tuple[str, int], float] = {}

    def observe(self, intakes: Iterable[PartitionIntake]) -> list[PartitionIntake]:
        now = self._clock()
        stuck = []
        seen = set()
        for intake in intakes:
            key = (intake.topic, intake.partition)
            seen.add(key)
            read = intake.read if intake.read is not None else intake.position
            behind = intake.highwater is not None and (read is None or intake.highwater > read + 1)
            last = self._since.get(key)
            if not behind or last is None or last[0] != read:
                self._since[key] = (read, now)
                self._said.pop(key, None)
                continue
            said = self._said.get(key)
            if now - last[1] >= self._stall_s and (said is None or now - said >= self._stall_s):
                self._said[key] = now
                stuck.append(intake)
        for key in set(self._since) - seen:  # moved away: forgotten
            self._since.pop(key, None)
            self._said.pop(key, None)
        return stuck
