"""Per-tenant TPM and RPM over a sliding 60 s window, in 100 ms buckets.

A pure policy over plain data. A window's state is its reservations, one per request of
the last 60 s, in a ``Reservations`` mapping a store may persist record by record (the
Faust job keeps each in a changelog-backed table); the bucket sums the checks read are
derived from them (``WindowState.of``), so a restarted job resumes with the same counts
from the reservations alone.

- ``reserve`` charges a request's estimate (prompt + max_tokens) up front;
- ``settle`` replaces the estimate by the real count when the UsageEvent arrives,
  refunding what went unused or charging an overrun, in the bucket it was reserved in;
- a request already reserved (a redelivery after a restart) is admitted without being
  charged twice;
- optionally, ``Limits.burst_s`` smooths a tenant's spending: in any ``burst_s`` seconds
  it may reserve at most its minute's tokens pro rata (``tpm * burst_s / 60``), so a
  tenant sending far above its TPM spends its minute evenly instead of in the minute's
  first seconds, and the fleet's other tenants do not take that burst. A request larger
  than the allowance still fits a short window that is empty.

Every change to the sums is a change to one reservation (``reserve`` adds one,
``settle`` replaces its count, ``release`` removes it), so a bucket's sums are always its
reservations' tokens and number: a request writes its own reservation, and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field

WINDOW_S = 60
BUCKETS_PER_S = 10
"""The window slides in steps of 100 ms: the limit holds over any 60 s to within a step."""
EXPIRE_PER_CALL = 64
"""The most reservations one request forgets. A tenant back after a quiet minute would
otherwise forget its whole last minute at once, inside one request's admission. (When the
job kept each reservation as a record of its own, that was as many tombstones on the
changelog: the first request after a c=64 minute forgot 1,450, and the Faust job's
producer buffer stalled every stream for 90 ms while they went out; BENCHMARKS.md,
section 7. The job's reservations now live in its ledger entries, and forgetting one
writes nothing.) Reservations out of the window and not yet forgotten count as gone."""


def window_key(tenant_id: str, batch_id: str | None = None) -> str:
    """The window a request is charged to: its tenant's, or for a line of a batch job the
    tenant's batch window ``<tenant>/batch``, with a budget of its own. Tenant ids hold
    no ``/``, so the two never meet."""
    return tenant_id if batch_id is None else f"{tenant_id}/batch"


def _bucket(now: float) -> int:
    # A float's width of slack: a time computed as a boundary (``now + retry_after``) can
    # land a hair short of it, and must count as the next bucket, as it was meant.
    return math.floor(now * BUCKETS_PER_S + 1e-6)


def _oldest(now: float) -> int:
    """The oldest bucket still in the window at ``now``."""
    return _bucket(now) - WINDOW_S * BUCKETS_PER_S + 1


@dataclass(frozen=True)
class Limits:
    tpm: int
    rpm: int
    burst_s: float = 0.0
    """Smoothing over any ``burst_s`` seconds (see the module's docstring); 0 is off: the
    whole minute's tokens may be spent at once."""

    def burst_allowance(self) -> float:
        return self.tpm * self.burst_s / WINDOW_S


@dataclass(frozen=True)
class Decision:
    admitted: bool
    retry_after_s: float = 0.0
    num_tokens_used: int = 0
    """Tokens in the window after this decision."""
    num_requests_used: int = 0
    reason: str = ""
    duplicate: bool = False
    """The request was reserved and settled before: it already ran (a redelivery)."""


class Reservations(MutableMapping[str, list[int]]):
    """request_id -> [bucket, tokens, settled], in memory; stores may persist each entry.

    Entries are replaced whole, never changed in place, so that a store writing through
    sees every change. ``expire`` drops the entries older than a bucket, oldest first."""

    def __init__(self, entries: dict[str, list[int]] | None = None) -> None:
        self._entries: dict[str, list[int]] = entries if entries is not None else {}

    def __getitem__(self, request_id: str) -> list[int]:
        return self._entries[request_id]

    def __setitem__(self, request_id: str, entry: list[int]) -> None:
        self._entries[request_id] = entry

    def __delitem__(self, request_id: str) -> None:
        del self._entries[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def live(self, request_id: str, oldest: int) -> list[int] | None:
        """The request's entry if it is in the window (bucket ``oldest`` or later)."""
        entry = self._entries.get(request_id)
        return entry if entry is not None and entry[0] >= oldest else None

    def expire(self, oldest: int, limit: int = EXPIRE_PER_CALL) -> None:
        """Forgets at most ``limit`` entries older than ``oldest``; later calls forget the
        rest (``live`` counts them as gone meanwhile)."""
        # Buckets grow with arrival, and replacing an entry keeps its place: the entries
        # to drop lead the insertion order. (Should the clock step back, a few may stay
        # a little longer, as if still in the window.)
        stale: list[str] = []
        for request_id, (bucket, *_) in self._entries.items():
            if bucket >= oldest or len(stale) == limit:
                break
            stale.append(request_id)
        for request_id in stale:
            del self[request_id]


@dataclass
class WindowState:
    buckets: dict[int, list[int]] = field(default_factory=dict)
    """Bucket (100 ms since the epoch) -> [tokens, requests] charged in it."""
    reservations: Reservations = field(default_factory=Reservations)
    """request_id -> [bucket, tokens, settled]: kept until it leaves the window, so that a
    redelivered request is recognised and never charged twice (forgotten a bounded share
    per call after that: ``EXPIRE_PER_CALL``)."""
    num_tokens: int = 0
    """The buckets' tokens summed, kept as they change: a tenant busy all minute has 600
    buckets, and summing them for each request cost the job 60 µs (``bench.window_cost``)."""
    num_requests: int = 0
    """The buckets' requests summed, kept likewise."""

    @classmethod
    def of(cls, reservations: Reservations) -> WindowState:
        """The state these reservations make (in bucket order, as ``Reservations``
        keeps them): each bucket's sums are its reservations' tokens and number (those
        out of the window go at the next ``expire``)."""
        state = cls(reservations=reservations)
        for bucket, tokens, _ in reservations.values():
            state._change(state.buckets.setdefault(bucket, [0, 0]), tokens, 1)
        return state

    def expire(self, now: float) -> None:
        oldest = _oldest(now)
        # Buckets are made as the clock moves on, so the old ones lead the insertion
        # order. (Should the clock step back, a bucket made then leaves a little late,
        # counted meanwhile, as ``Reservations.expire`` says of its entries.)
        stale: list[int] = []
        for key in self.buckets:
            if key >= oldest:
                break
            stale.append(key)
        for key in stale:
            tokens, requests = self.buckets.pop(key)
            self.num_tokens -= tokens
            self.num_requests -= requests
        self.reservations.expire(oldest)

    def used(self) -> tuple[int, int]:
        return self.num_tokens, self.num_requests

    def _change(self, bucket: list[int], tokens: int, requests: int = 0) -> None:
        """Adds to a bucket's sums (never below 0), and to the totals by as much."""
        new_tokens, new_requests = max(0, bucket[0] + tokens), max(0, bucket[1] + requests)
        self.num_tokens += new_tokens - bucket[0]
        self.num_requests += new_requests - bucket[1]
        bucket[0], bucket[1] = new_tokens, new_requests


def reserve(
    state: WindowState, request_id: str, num_tokens: int, limits: Limits, now: float
) -> Decision:
    """Admits and charges the request, or says how long until it would fit."""
    state.expire(now)
    tokens, requests = state.used()
    known = state.reservations.live(request_id, _oldest(now))
    if known is not None:
        return Decision(
            True, num_tokens_used=tokens, num_requests_used=requests, duplicate=bool(known[2])
        )
    if num_tokens > limits.tpm:
        return Decision(
            False,
            retry_after_s=0.0,
            num_tokens_used=tokens,
            num_requests_used=requests,
            reason=f"needs {num_tokens} tokens, more than the {limits.tpm} per minute",
        )
    if tokens + num_tokens > limits.tpm or requests + 1 > limits.rpm:
        return Decision(
            False,
            retry_after_s=_retry_after(state, num_tokens, limits, now),
            num_tokens_used=tokens,
            num_requests_used=requests,
            reason="tpm" if tokens + num_tokens > limits.tpm else "rpm",
        )
    if limits.burst_s > 0:
        recent = _recent_tokens(state, now, limits.burst_s)
        if recent > 0 and recent + num_tokens > limits.burst_allowance():
            return Decision(
                False,
                retry_after_s=_burst_retry_after(state, num_tokens, limits, now),
                num_tokens_used=tokens,
                num_requests_used=requests,
                reason=f"tpm_burst: at most {limits.burst_allowance():.0f} tokens in any "
                f"{limits.burst_s:g} s (the minute's {limits.tpm} spread evenly)",
            )
    key = _bucket(now)
    state._change(state.buckets.setdefault(key, [0, 0]), num_tokens, 1)
    if request_id in state.reservations:  # out of the window, not yet forgotten
        del state.reservations[request_id]  # the new entry goes last, as expire expects
    state.reservations[request_id] = [key, num_tokens, 0]
    return Decision(True, num_tokens_used=tokens + num_tokens, num_requests_used=requests + 1)


def settle(state: WindowState, request_id: str, num_tokens_actual: int, now: float) -> int | None:
    """Replaces the reservation by the real count; returns the change (negative = refund).

    None when there is nothing to settle: settled already, or out of the window.
    """
    state.expire(now)
    reservation = state.reservations.live(request_id, _oldest(now))
    if reservation is None or reservation[2]:
        return None
    key, reserved, _ = reservation
    state.reservations[request_id] = [key, num_tokens_actual, 1]
    delta = num_tokens_actual - reserved
    bucket = state.buckets.get(key)
    if bucket is not None:
        state._change(bucket, delta)
    return delta


def release(state: WindowState, request_id: str, now: float) -> None:
    """A request that never ran (refused after admission, or cancelled while queued)."""
    state.expire(now)
    reservation = state.reservations.live(request_id, _oldest(now))
    if reservation is None or reservation[2]:
        return
    del state.reservations[request_id]
    key, reserved, _ = reservation
    bucket = state.buckets.get(key)
    if bucket is not None:
        state._change(bucket, -reserved, -1)


def _retry_after(state: WindowState, num_tokens: int, limits: Limits, now: float) -> float:
    """Seconds until enough of the window has slid out for this request to fit."""
    tokens, requests = state.used()
    for key in sorted(state.buckets):
        bucket_tokens, bucket_requests = state.buckets[key]
        tokens -= bucket_tokens
        requests -= bucket_requests
        if tokens + num_tokens <= limits.tpm and requests + 1 <= limits.rpm:
            return max(0.001, key / BUCKETS_PER_S + WINDOW_S - now)
    return float(WINDOW_S)


def _short_window(now: float, burst_s: float) -> int:
    """The oldest bucket of the last ``burst_s`` seconds at ``now``."""
    return _bucket(now) - math.ceil(burst_s * BUCKETS_PER_S - 1e-6) + 1


def _recent_tokens(state: WindowState, now: float, burst_s: float) -> int:
    oldest = _short_window(now, burst_s)
    return sum(tokens for key, (tokens, _) in state.buckets.items() if key >= oldest)


def _burst_retry_after(state: WindowState, num_tokens: int, limits: Limits, now: float) -> float:
    """Seconds until enough of the short window has slid out for this request to fit."""
    oldest = _short_window(now, limits.burst_s)
    recent = _recent_tokens(state, now, limits.burst_s)
    for key in sorted(k for k in state.buckets if k >= oldest):
        recent -= state.buckets[key][0]
        if recent <= 0 or recent + num_tokens <= limits.burst_allowance():
            return max(0.001, key / BUCKETS_PER_S + limits.burst_s - now)
    return limits.burst_s
