"""Which attempts of a batch may already be stored: an index of the recent ones, in memory.

The sink must leave out every attempt ClickHouse already holds (``billing.dedup``).
Asking ClickHouse about every attempt of every batch was a quarter of the sink's CPU,
yet almost every attempt is new. ``RecentAttempts`` answers for most of them without
a query: it is *complete from its horizon*, meaning it holds a hash of every attempt
ClickHouse stores (for the sink's partitions) that was created at or after the horizon.
Then an attempt created at or after the horizon whose hash it lacks is certainly new,
and only two kinds of attempts are *unsure*, to be looked up in ClickHouse as before:

- a hash it holds: a copy of a stored attempt (a redelivery, a replay, a re-served
  request), or, about once in 2^64, another attempt with the same hash;
- an attempt created before the horizon: a late copy of an old attempt, or a replay;
- an attempt created less than ``margin_s`` after the horizon. The copies of one attempt
  may have been created apart: a request the Faust job admitted again after a crash
  (its ledger entry lost with it) runs again under the same key, created at its second
  admission. A copy created ``margin_s`` or more after the horizon has any other copy
  created within ``margin_s`` of it, so at or after the horizon, and in the index.

A first attempt reported after a later attempt of its request (a worker presumed lost
that was only slow: ``billing.dedup.later_runs``) must be unsure too, though it is not
stored: so a stored later attempt also puts its request's first attempt in the index.

Completeness is kept by construction: the sink builds the index from ClickHouse (every
attempt created since a moment, ``from_stored``) when partitions are assigned to it, and
adds each attempt it inserts once ClickHouse acknowledged it. Copies of an attempt share
its tenant, and usage records are keyed by tenant, so they reach the partition, and the
sink, that billed the first one. To stay within ``capacity`` the index forgets its oldest
minutes of ``created_at`` and moves its horizon past them, which keeps it complete.

Pure: no I/O and no clock; time is the events' own ``created_at``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from itertools import compress
from typing import Protocol

from billing.dedup import Attempt, UsageKey, is_resent
from billing.rows import millis


class HasCreatedAt(Protocol):
    @property
    def created_at(self) -> datetime: ...


class RecentAttempts:
    """Hashes of the stored attempts created at or after ``horizon``, by minute."""

    def __init__(
        self, capacity: int, horizon: datetime | None = None, *, margin_s: float = 0.0
    ) -> None:
        """An index of nothing, complete from ``horizon`` (None: from the beginning of
        time, which is right for an empty table); copies of one attempt are created at
        most ``margin_s`` apart."""
        self.capacity = max(1, capacity)
        self.margin_s = margin_s
        self._horizon_s = -math.inf if horizon is None else _seconds(horizon)
        self._horizon = None if horizon is None else _aware(horizon)
        self._sure_from = self._sure_from_of(self._horizon)
        self._minute_of: dict[int, int] = {}
        """Hash --> the newest minute (of ``created_at``) an attempt with it was added in."""
        self._by_minute: dict[int, list[int]] = {}

    @classmethod
    def from_stored(
        cls,
        stored: Iterable[Attempt],
        complete_from: datetime | None,
        capacity: int,
        *,
        margin_s: float = 0.0,
    ) -> RecentAttempts:
        """The index of ``stored``: every stored attempt created at or after
        ``complete_from`` (None: every stored attempt)."""
        index = cls(capacity, complete_from, margin_s=margin_s)
        index.add(stored)
        return index

    @property
    def horizon(self) -> datetime | None:
        """The index holds every stored attempt created from this instant on; None: every
        stored attempt."""
        return self._horizon

    @property
    def sure_from(self) -> datetime | None:
        """Attempts created before this instant (the horizon and ``margin_s``) are always
        unsure; None: none are."""
        return self._sure_from

    def _sure_from_of(self, horizon: datetime | None) -> datetime | None:
        return None if horizon is None else horizon + timedelta(seconds=self.margin_s)

    def __len__(self) -> int:
        return len(self._minute_of)

    def is_unsure(self, key: UsageKey, created_at: datetime) -> bool:
        """True if ClickHouse may hold ``key``; False only if it certainly does not."""
        if self._sure_from is not None and _aware(created_at) < self._sure_from:
            return True
        return hash(key) in self._minute_of

    def unsure_keys(self, keyed: Iterable[tuple[UsageKey, HasCreatedAt]]) -> list[UsageKey]:
        """The keys of ``keyed`` (keys with their events) that ``is_unsure``, in order."""
        minute_of = self._minute_of
        horizon = self._sure_from
        keyed = list(keyed)
        # Almost always no key is unsure: said by C loops, without a Python step per key.
        if (
            horizon is None or _none_before([event.created_at for _, event in keyed], horizon)
        ) and minute_of.keys().isdisjoint(map(hash, [key for key, _ in keyed])):
            return []
        if horizon is None:
            return [key for key, _ in keyed if hash(key) in minute_of]
        return [
            key
            for key, event in keyed
            if _aware(event.created_at) < horizon or hash(key) in minute_of
        ]

    def add(self, attempts: Iterable[Attempt]) -> None:
        """Records attempts ClickHouse now holds, then forgets the oldest minutes while
        over capacity. Attempts created before the horizon are not kept: they are unsure
        anyway."""
        pairs = list(attempts)
        self.add_ticks([key for key, _ in pairs], millis([created for _, created in pairs]))

    def add_ticks(self, keys: Sequence[UsageKey], created_ticks: Sequence[int]) -> None:
        """``add`` of attempts given as keys and their ``created_at`` in DateTime64(3)
        ticks (milliseconds since the epoch, rounded down), as the sink inserts them."""
        if len(keys) != len(created_ticks):
            raise ValueError(f"{len(keys)} keys but {len(created_ticks)} ticks")
        if is_resent(keys):
            # A first attempt reported after this one is unsure: its request ran again.
            firsts = [(k[0], k[1], k[2], 0) for k in keys if k[3]]
            their_ticks = [t for k, t in zip(keys, created_ticks, strict=True) if k[3]]
            keys, created_ticks = [*keys, *firsts], [*created_ticks, *their_ticks]
        minute_of = self._minute_of
        by_minute = self._by_minute
        # Tick t stands for an instant in [t, t + 1) ms: one created before the horizon
        # (t + 1 <= horizon) is left out, as ``add`` leaves it; the minute is the same.
        last_left_out = self._horizon_s * 1000.0 - 1.0
        none_left_out = bool(keys) and min(created_ticks) > last_left_out
        if not (none_left_out and self._add_new(keys, created_ticks)):
            for key, ticks in zip(keys, created_ticks, strict=True):
                if ticks <= last_left_out:
                    continue
                minute = ticks // 60_000
                digest = hash(key)
                known = minute_of.get(digest)
                if known is None or known < minute:
                    minute_of[digest] = minute
                    by_minute.setdefault(minute, []).append(digest)
        while len(minute_of) > self.capacity:
            self._forget_oldest_minute()

    def _add_new(self, keys: Sequence[UsageKey], created_ticks: Sequence[int]) -> bool:
        """``add_ticks`` of attempts none of whose hashes is held or repeated, all created
        at or after the horizon (as the sink's inserts are), in C loops; False, having
        changed nothing, for any others."""
        digests = list(map(hash, keys))
        minutes = [ticks // 60_000 for ticks in created_ticks]
        new = dict(zip(digests, minutes, strict=True))
        distinct = set(minutes)
        if (
            len(new) != len(digests)
            or len(distinct) > _MAX_MINUTES_AT_ONCE
            or not self._minute_of.keys().isdisjoint(new)
        ):
            return False
        self._minute_of.update(new)
        for minute in sorted(distinct):
            added = self._by_minute.setdefault(minute, [])
            if len(distinct) == 1:
                added += digests
            else:
                added += compress(digests, map(minute.__eq__, minutes))
        return True

    def _forget_oldest_minute(self) -> None:
        oldest = min(self._by_minute)
        for digest in self._by_minute.pop(oldest):
            # A hash added again in a later minute stays, for that later attempt.
            if self._minute_of.get(digest) == oldest:
                del self._minute_of[digest]
        # Complete from the next minute on: nothing created in it or later was dropped.
        if (oldest + 1) * 60.0 > self._horizon_s:
            self._horizon_s = (oldest + 1) * 60.0
            self._horizon = datetime.fromtimestamp(self._horizon_s, UTC)
            self._sure_from = self._sure_from_of(self._horizon)


_MAX_MINUTES_AT_ONCE = 16
"""``_add_new`` walks the digests once per minute they span: past this, the loop does."""


def _none_before(instants: list[datetime], horizon: datetime) -> bool:
    """No instant is before ``horizon``; False, to be asked one by one, if naive and
    aware ones are mixed (``min`` cannot compare them)."""
    try:
        return not instants or _aware(min(instants)) >= horizon
    except TypeError:
        return False


def _aware(at: datetime) -> datetime:
    # The bus speaks UTC: a naive timestamp is read as UTC, as ``billing.rows`` stores it.
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _seconds(at: datetime) -> float:
    return _aware(at).timestamp()
