"""A consumer's fetch wait, fitted to the bundled broker (tansu profile only): longer
while its fetches come back empty behind the high-water mark, shorter while it expects a
record.

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

The other way (``expect_records``, ``after_quiet``): tansu looks at a parked fetch when
it arrives and then at about 58%, 84% and 98% of its wait (``bench.parked_fetch``), so
a record that lands early in a fetch waits over half the wait for the next look. A
consumer that expects a record soon fetches with a short wait (``eager_ms``) until one
comes, for at most ``window_s``. It expects one where requests come one at a time, as
from a caller that sends its next request when its last one ends (``LoneRequests``): a
worker gone idle, a client sending a request, and the Faust job when a lone record
comes after a quiet spell (there, a usage record: a request's end). Under concurrent
load requests overlap and records come in bursts, so the short wait stays off there,
where it would only return fetches with fewer records in each.

On Apache Kafka a fetch behind the high-water mark returns records, a parked fetch is
answered as soon as a record arrives, and the ``kafka`` profile installs none of this.
"""

from __future__ import annotations

import logging
import time
import weakref
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
_after_quiet: weakref.WeakSet[Any] = weakref.WeakSet()
"""The subscription states of consumers that expect records after a quiet spell."""


class FetchWait:
    """One consumer's fetch wait, from what its fetches returned. Pure."""

    def __init__(
        self,
        base_ms: int,
        cap_ms: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        eager_ms: int = 0,
        window_s: float = 0.05,
        after_quiet: bool = False,
    ) -> None:
        self.base_ms = base_ms
        self.cap_ms = max(cap_ms, base_ms)
        self.wait_ms = base_ms
        """The wait the stall rule holds: the base, or raised above it."""
        self.eager_ms = eager_ms if 0 < eager_ms < base_ms else 0
        """The wait while a record is expected; 0: never shorter than the base."""
        self.window_s = window_s
        self.after_quiet = after_quiet
        """A lone record after ``window_s`` without any opens the window too."""
        self._clock = clock
        self._stalls = 0
        self._last_stall = clock()
        self._stuck_said_at: float | None = None
        self._eager_until = 0.0
        self._last_records = float("-inf")

    @property
    def current_ms(self) -> int:
        """The wait for the next fetch: short while a record is expected and the stall
        rule has not raised the wait (a raised wait means the broker needs longer)."""
        return self._wait_at(self._clock())

    def _wait_at(self, now: float) -> int:
        if self.eager_ms and self.wait_ms == self.base_ms and now < self._eager_until:
            return self.eager_ms
        return self.wait_ms

    def counts_records(self) -> bool:
        """Whether the next ``after_fetch`` reads how many records came, rather than
        only whether any did: only a lone record after a quiet spell opens the window."""
        return bool(
            self.eager_ms
            and self.after_quiet
            and self._clock() - self._last_records >= self.window_s
        )

    def expect(self) -> int:
        """A record is likely soon: fetch with the short wait until one comes, for at
        most ``window_s``. Returns the wait for the next fetch."""
        now = self._clock()
        if self.eager_ms:
            self._eager_until = now + self.window_s
        return self._wait_at(now)

    def after_fetch(self, stalled: bool, num_records: int = 0) -> int:
        """``stalled``: a partition of the fetch came back without records although
        the broker's high-water mark is beyond the position. ``num_records``: how many
        the fetch brought; any end the wait for one, and with ``after_quiet`` a lone
        record after ``window_s`` without any opens the window again (one request at a
        time: a burst says the traffic is not). Returns the next fetch's wait."""
        now = self._clock()
        if num_records and self.eager_ms:
            lone = num_records == 1 and now - self._last_records >= self.window_s
            self._eager_until = now + self.window_s if self.after_quiet and lone else 0.0
            self._last_records = now
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
        return self._wait_at(now)

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


def fetched_records(fetcher_: Any, assignment: Any, request: Any) -> int:
    """How many records the answer to ``request`` brought, by the high-water marks it
    carried (the records themselves are decoded only as they are read): at least 1 for
    each partition it brought records for."""
    num = 0
    for topic, partitions in request.topics:
        for partition, offset, _ in partitions:
            tp = TopicPartition(topic, partition)
            if tp not in fetcher_._records:
                continue
            state = assignment.state_value(tp)
            highwater = getattr(state, "highwater", None)
            num += max(1, highwater - offset) if highwater is not None else 1
    return num


class LoneRequests:
    """Whether a process's requests come one at a time, as from a caller that sends its
    next request when its last one ends: then, once the process is idle, the next one
    is likely soon (``expect_records``). Under concurrent load requests overlap, and an
    idle moment says nothing. Pure."""

    def __init__(self) -> None:
        self._crowded = False

    def running(self, num: int) -> None:
        """A request started; ``num`` run now."""
        if num > 1:
            self._crowded = True

    def idle(self) -> bool:
        """Nothing runs now: whether each request since the last idle moment ran alone.
        Starts the next such spell."""
        alone, self._crowded = not self._crowded, False
        return alone


def _stamped(state: Any, since_ms: int) -> bool:
    return state.timestamp is not None and state.timestamp >= since_ms


def adapt_fetch_waits(cap_ms: int, eager_ms: int = 0, eager_window_ms: int = 50) -> None:
    """Installs the rules in aiokafka's fetcher for this process (idempotent). Each
    consumer starts from its own ``fetch_max_wait_ms`` and takes the settings given last
    before its first fetch: a cap at or below its wait (0) turns the stall rule off for
    it, an ``eager_ms`` of 0 (or not below its wait) the short wait."""
    _installed.update(cap_ms=cap_ms, eager_ms=eager_ms, eager_window_s=eager_window_ms / 1000)
    if _patch.on:
        return
    original = _patch.original()

    async def proc_fetch_request(self: Any, assignment: Any, node_id: int, request: Any) -> Any:
        since_ms = int(1000 * time.time())  # aiokafka's clock for an answer's stamp
        result = await original(self, assignment, node_id, request)
        rule = _rule(self)
        if not assignment.active:
            return result
        # Counted only where a lone record could open the window: after a quiet spell.
        num_records = int(bool(result))
        if num_records and rule.counts_records():
            num_records = fetched_records(self, assignment, request)
        if rule.cap_ms <= rule.base_ms:  # the stall rule is off for this consumer
            self._fetch_max_wait_ms = rule.after_fetch(False, num_records)
            return result
        stalled = stalled_partitions(self, assignment, request, since_ms)
        before = rule.wait_ms
        self._fetch_max_wait_ms = rule.after_fetch(bool(stalled), num_records)
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


def _rule(fetcher_: Any) -> FetchWait:
    """The fetcher's rule, made on first use from its configured wait."""
    rule: FetchWait | None = getattr(fetcher_, "_tokenbus_fetch_wait", None)
    if rule is None:
        rule = fetcher_._tokenbus_fetch_wait = FetchWait(
            fetcher_._fetch_max_wait_ms,
            _installed["cap_ms"],
            eager_ms=_installed["eager_ms"],
            window_s=_installed["eager_window_s"],
            after_quiet=fetcher_._subscriptions in _after_quiet,
        )
    return rule


def expect_records(consumer: Any) -> None:
    """A hint from ``consumer``'s owner: a record is likely soon, so its next fetches
    wait briefly (``FetchWait.expect``). Nothing unless the rules are installed (the
    tansu profile) and the consumer has started; a fetch already parked keeps its wait."""
    fetcher_ = getattr(consumer, "_fetcher", None)
    if not _patch.on or fetcher_ is None or not _installed.get("eager_ms"):
        return
    fetcher_._fetch_max_wait_ms = _rule(fetcher_).expect()


def expect_after_quiet(consumer: Any) -> None:
    """Marks ``consumer`` (before its first fetch): a lone record after a quiet spell
    means another is likely soon (``FetchWait.after_quiet``)."""
    _after_quiet.add(consumer._subscription)


def uninstall() -> None:
    """aiokafka's fetcher as it ships again (consumers made before keep their wait)."""
    _patch.undo()
    _installed.clear()
