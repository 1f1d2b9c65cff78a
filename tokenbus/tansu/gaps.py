"""Consumers refetch across an offset gap before they accept it (tansu profile only).

Seen with tansu 0.6.0, the bundled development broker: when several producers write one
partition at once, a fetch can return a later batch before an earlier one is visible.
The consumer then moves past the earlier batch and never reads it: a reply stream
hangs, a request or a usage event is lost. It was measured with 2 to 4 producers on one
partition: 3 to 18 of 12,000 records skipped by a tailing consumer, while a reader
from the beginning found all of them stored (``bench/gaps.py``).

Here, a record whose offset is beyond the next one expected ends the fetch result at
the gap, so the consumer fetches again from the gap; a gap still there after
``settle_s`` is accepted as real. Only topics under the configured prefix are watched
(Faust's changelogs are compacted, and have gaps). Offsets that an earlier batch of the
same fetch accounts for (a control batch, that is a transaction marker, an aborted
transaction, a compacted tail) are no gap: aiokafka moves past those itself, and
waiting on them would stall the partition.

On Apache Kafka a consumer never sees an offset before the ones below it are readable,
and its gaps (transaction markers, compaction) are real: the ``kafka`` profile never
installs this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from aiokafka.consumer import fetcher

from tokenbus.tansu.patch import Patch

log = logging.getLogger(__name__)

PATCH = Patch(fetcher.PartitionRecords, "_unpack_records")
_installed: dict[str, Any] = {}


class GapBook:
    """When each gap was first seen; whether to refetch it once more. Pure."""

    def __init__(self, settle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._settle_s = settle_s
        self._clock = clock
        self._first_seen: dict[tuple[str, int, int], float] = {}

    def refetch(self, topic: str, partition: int, offset: int) -> bool:
        now = self._clock()
        key = (topic, partition, offset)
        first = self._first_seen.setdefault(key, now)
        if now - first < self._settle_s:
            if len(self._first_seen) > 10_000:  # gaps that closed are never asked again
                self._first_seen = {
                    k: t for k, t in self._first_seen.items() if now - t < 10 * self._settle_s
                }
            return True
        del self._first_seen[key]
        log.warning(
            "offset gap in %s[%d] at %d still there after %.1f s: accepted as real",
            topic,
            partition,
            offset,
            now - first,
        )
        return False


class _BatchWatch:
    """The fetched records as aiokafka's unpacking reads them, noting how far the batches
    handed out before the current one account for offsets: up to each one's
    ``next_offset``, whether aiokafka yielded its records, skipped it (a control batch,
    an aborted transaction) or found its tail compacted away."""

    def __init__(self, records: Any) -> None:
        self._records = records
        self._current: Any = None
        self.accounted_to = -1

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        if self._current is not None:
            self.accounted_to = max(self.accounted_to, self._current.next_offset)
        self._current = self._records.next_batch()
        return self._current

    def __getattr__(self, name: str) -> Any:
        return getattr(self._records, name)


def refetching_unpack(
    original: Callable[[Any], Iterator[Any]], book: GapBook, topic_prefix: str
) -> Callable[[Any], Iterator[Any]]:
    """``PartitionRecords._unpack_records`` that stops before a new gap in a watched topic,
    leaving the position at the gap, so the next fetch asks for it again."""

    def unpack(self: Any) -> Iterator[Any]:
        topic, partition = self._tp.topic, self._tp.partition
        if not topic.startswith(topic_prefix):
            return original(self)
        return watched(self, topic, partition)

    def watched(self: Any, topic: str, partition: int) -> Iterator[Any]:
        self._records = watch = _BatchWatch(self._records)
        expected = self.next_fetch_offset
        for record in original(self):
            offset = record.offset
            # A gap: beyond the next offset expected and beyond what earlier batches
            # account for (read only then: once per batch at most, not per record).
            if offset > expected:
                gap_at = max(expected, watch.accounted_to)
                if offset > gap_at and book.refetch(topic, partition, gap_at):
                    self.next_fetch_offset = gap_at  # the position stays before the gap
                    return
            expected = offset + 1
            yield record

    return unpack


def refetch_across_gaps(topic_prefix: str, settle_s: float) -> None:
    """Installs the check in aiokafka's fetcher for this process (idempotent)."""
    if settle_s <= 0 or _installed.get("prefix") == topic_prefix:
        return
    PATCH.put(refetching_unpack(PATCH.original(), GapBook(settle_s), topic_prefix))
    _installed["prefix"] = topic_prefix


def uninstall() -> None:
    """aiokafka's fetcher as it ships again."""
    PATCH.undo()
    _installed.clear()
