"""A consumer whose fetches keep coming back empty behind the high-water mark lets the
broker take longer over them (tansu profile only).

Seen with tansu 0.6.0, the bundled development broker: a fetch costs it more the more
record batches the partition holds, and it stops reading at ``fetch_max_wait_ms``. Once
one fetch of a partition costs more than the wait (10,000 one-record batches at
5 ms, measured by ``bench/fetch_cost.py``), every fetch comes back empty, and the
consumer stands still behind the high-water mark for good: a client's replies stop, the
job stops seeing heartbeats. Reply topics grow one batch per engine step, so they get
there first, in minutes under load.

The rule (``FetchWait``): after ``STALLS_TO_RAISE`` such fetches in a row, the consumer
doubles its wait, up to ``cap_ms``; after ``QUIET_S`` without one, it halves it again,
down to the configured wait, which is kept short because the bundled broker answers a
parked fetch later the longer its wait (``Settings.fetch_max_wait_ms``). A partition the
answer leaves out, or answers with an error, counts as stalled too: its high-water mark
is then the last one seen, and none at all on a consumer's first fetches (a restarted
job's), so it would otherwise never count. Stalls that go on at the cap are logged once
per ``QUIET_S``, rather than not at all.

On Apache Kafka a fetch behind the high-water mark returns records, and the ``kafka``
profile never installs this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka import TopicPartition
from aiokafka.consumer import fetcher

from tokenbus.tansu.patch import Patch

log = logging.getLogger(__name__)

STALLS_TO_RAISE = 5
"""Empty fetches behind the high-water mark in a row before the wait doubles; one or
two happen when the broker merely lost the CPU for a moment."""
QUIET_S = 30.0
"""How long the raised wait is kept after the last stall before it is halved."""

_patch = Patch(fetcher.Fetcher, "_proc_fetch_request")
_installed: dict[str, Any] = {}


class FetchWait:
    """One consumer's fetch wait, from what its fetches returned. Pure."""

    def __init__(
        self, base_ms: int, cap_ms: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.base_ms = base_ms
        self.cap_ms = max(cap_ms, base_ms)
        self.wait_ms = base_ms
        self._clock = clock
        self._stalls = 0
        self._last_stall = clock()
        self._stuck_said_at: float | None = None

    def after_fetch(self, stalled: bool) -> int:
        """``stalled``: a partition of the fetch came back without records although
        the broker's high-water mark is beyond the position. Returns the new wait."""
        now = self._clock()
        if stalled:
            self._stalls += 1
            self._last_stall = now
            if self._stalls >= STALLS_TO_RAISE and self.wait_ms < self.cap_ms:
                self.wait_ms = min(self.cap_ms, self.wait_ms * 2)
                self._stalls = 0
        else:
            self._stalls = 0
            if self.wait_ms > self.base_ms and now - self._last_stall >= QUIET_S:
                self.wait_ms = max(self.base_ms, self.wait_ms // 2)
                self._last_stall = now  # one halving per quiet period
        return self.wait_ms

    def stuck(self) -> bool:
        """Whether fetches still stall with the wait at the cap: true once per
        ``QUIET_S`` while they do, so that a consumer that stopped moving says so."""
        if self.wait_ms < self.cap_ms or self._stalls < STALLS_TO_RAISE:
            return False
        now = self._clock()
        if self._stuck_said_at is not None and now - self._stuck_said_at < QUIET_S:
            return False
        self._stuck_said_at = now
        return True


def stalled_partitions(
    fetcher_: Any, assignment: Any, request: Any, since_ms: int | None = None
) -> list[TopicPartition]:
    """The partitions of ``request`` that got no records while behind the high-water mark,
    and, given ``since_ms`` (wall-clock ms when the fetch was sent), those an answer left
    out or answered with an error: aiokafka stamps a partition's state with the time of
    each answer without error, so one stamped before ``since_ms`` got none. A fetch that
    failed as a whole (no partition stamped: the broker unreachable) stalls nothing. A
    partition whose position moved meanwhile (a seek) has not stalled."""
    behind, unanswered, answered = [], [], False
    for topic, partitions in request.topics:
        for partition, offset, _ in partitions:
            tp = TopicPartition(topic, partition)
            state = assignment.state_value(tp)
            stamped = state is not None and since_ms is not None and _stamped(state, since_ms)
            answered = answered or stamped
            if tp in fetcher_._records:
                continue
            if state is None or not state.has_valid_position or state.position != offset:
                continue
            if state.highwater is not None and state.highwater > offset:
                behind.append(tp)
            elif since_ms is not None and not stamped:
                unanswered.append(tp)
    return behind + unanswered if answered else behind


def _stamped(state: Any, since_ms: int) -> bool:
    return state.timestamp is not None and state.timestamp >= since_ms


def lengthen_stalled_fetches(cap_ms: int) -> None:
    """Installs the rule in aiokafka's fetcher for this process (idempotent). Each
    consumer starts from its own ``fetch_max_wait_ms`` and takes the cap given last
    before its first fetch; a cap at or below its wait (0) turns the rule off for it."""
    _installed["cap_ms"] = cap_ms
    if _patch.on:
        return
    original = _patch.original()

    async def proc_fetch_request(self: Any, assignment: Any, node_id: int, request: Any) -> Any:
        since_ms = int(1000 * time.time())  # aiokafka's clock for an answer's stamp
        result = await original(self, assignment, node_id, request)
        rule = getattr(self, "_tokenbus_fetch_wait", None)
        if rule is None:
            rule = self._tokenbus_fetch_wait = FetchWait(
                self._fetch_max_wait_ms, _installed["cap_ms"]
            )
        if not assignment.active or rule.cap_ms <= rule.base_ms:
            return result
        stalled = stalled_partitions(self, assignment, request, since_ms)
        before = rule.wait_ms
        self._fetch_max_wait_ms = rule.after_fetch(bool(stalled))
        if rule.wait_ms > before:
            log.warning(
                "fetches of %s keep coming back empty behind the high-water mark: "
                "fetch wait %d -> %d ms (the broker needs longer per fetch)",
                ", ".join(f"{tp.topic}[{tp.partition}]" for tp in stalled),
                before,
                rule.wait_ms,
            )
        elif rule.stuck():
            log.warning(
                "fetches of %s still come back empty behind the high-water mark (or "
                "unanswered) at the longest fetch wait, %d ms: the consumer is not moving",
                ", ".join(f"{tp.topic}[{tp.partition}]" for tp in stalled),
                rule.wait_ms,
            )
        elif rule.wait_ms < before:
            log.info(
                "no stalled fetch for %.0f s: fetch wait %d -> %d ms",
                QUIET_S,
                before,
                rule.wait_ms,
            )
        return result

    _patch.put(proc_fetch_request)


def uninstall() -> None:
    """aiokafka's fetcher as it ships again (consumers made before keep their wait)."""
    _patch.undo()
    _installed.clear()
