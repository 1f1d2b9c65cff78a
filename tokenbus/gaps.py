"""Consumers refetch across an offset gap before they accept it.

Seen with tansu 0.6.0, the bundled development broker: when several producers write one
partition at once, a fetch can return a later batch before an earlier one is visible.
The consumer then moves past the earlier batch and never reads it: a reply stream
hangs, a request or a usage event is lost. It was measured with 2 to 4 producers on one
partition: 3 to 18 of 12,000 records skipped by a tailing consumer, while a reader
from the beginning found all of them stored (``bench/gaps.py``).

On Apache Kafka a consumer never sees an offset before the ones below it are readable,
and tokenbus's topics have neither compaction nor transactions, so their offsets have no
gaps: there this changes nothing. Here, a record whose offset is beyond the next one
expected ends the fetch result at the gap, so the consumer fetches again from the gap;
a gap still there after ``settle_s`` is accepted as real. Only topics under the
configured prefix are watched (Faust's changelogs are compacted, and have gaps).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from aiokafka.consumer import fetcher

log = logging.getLogger(__name__)

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


def refetch_across_gaps(topic_prefix: str, settle_s: float) -> None:
    """Installs the check in aiokafka's fetcher for this process (idempotent)."""
    if settle_s <= 0 or _installed.get("prefix") == topic_prefix:
        return
    original = _installed.setdefault("original", fetcher.PartitionRecords._unpack_records)
    book = GapBook(settle_s)
    prefix = topic_prefix

    def unpack(self: Any) -> Iterator[Any]:
        topic, partition = self._tp.topic, self._tp.partition
        expected = self.next_fetch_offset
        for record in original(self):
            if (
                record.offset > expected
                and topic.startswith(prefix)
                and book.refetch(topic, partition, expected)
            ):
                self.next_fetch_offset = expected  # the position stays before the gap
                return
            expected = record.offset + 1
            yield record

    fetcher.PartitionRecords._unpack_records = unpack  # type: ignore[method-assign]
    _installed["prefix"] = topic_prefix
