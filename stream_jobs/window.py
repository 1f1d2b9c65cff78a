"""Per-tenant TPM and RPM over a sliding 60 s window, in one-second buckets.

A pure policy over plain data: ``WindowState`` round-trips through JSON, so the Faust job
keeps it in a changelog-backed table and a restarted job resumes with the same counts.

- ``reserve`` charges a request's estimate (prompt + max_tokens) up front;
- ``settle`` replaces the estimate by the real count when the UsageEvent arrives,
  refunding what went unused or charging an overrun, in the bucket it was reserved in;
- a request already reserved (a redelivery after a restart) is admitted without being
  charged twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 60


@dataclass(frozen=True)
class Limits:
    tpm: int
    rpm: int


@dataclass(frozen=True)
class Decision:
    admitted: bool
    retry_after_s: float = 0.0
    num_tokens_used: int = 0
    """Tokens in the window after this decision."""
    num_requests_used: int = 0
    reason: str = ""


@dataclass
class WindowState:
    buckets: dict[int, list[int]] = field(default_factory=dict)
    """Second -> [tokens, requests] charged in that second."""
    reservations: dict[str, list[int]] = field(default_factory=dict)
    """request_id -> [second, tokens reserved]; removed on settle or when it leaves the window."""

    def to_json(self) -> dict[str, Any]:
        return {"b": {str(k): v for k, v in self.buckets.items()}, "r": self.reservations}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> WindowState:
        if not data:
            return cls()
        return cls(
            buckets={int(k): list(v) for k, v in data.get("b", {}).items()},
            reservations={k: list(v) for k, v in data.get("r", {}).items()},
        )

    def expire(self, now: float) -> None:
        oldest = math.floor(now) - WINDOW_S + 1
        for second in [s for s in self.buckets if s < oldest]:
            del self.buckets[second]
        for request_id in [r for r, (s, _) in self.reservations.items() if s < oldest]:
            del self.reservations[request_id]

    def used(self) -> tuple[int, int]:
        return (
            sum(tokens for tokens, _ in self.buckets.values()),
            sum(requests for _, requests in self.buckets.values()),
        )


def reserve(
    state: WindowState, request_id: str, num_tokens: int, limits: Limits, now: float
) -> Decision:
    """Admits and charges the request, or says how long until it would fit."""
    state.expire(now)
    tokens, requests = state.used()
    if request_id in state.reservations:
        return Decision(True, num_tokens_used=tokens, num_requests_used=requests)
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
    second = math.floor(now)
    bucket = state.buckets.setdefault(second, [0, 0])
    bucket[0] += num_tokens
    bucket[1] += 1
    state.reservations[request_id] = [second, num_tokens]
    return Decision(True, num_tokens_used=tokens + num_tokens, num_requests_used=requests + 1)


def settle(state: WindowState, request_id: str, num_tokens_actual: int, now: float) -> int | None:
    """Replaces the reservation by the real count; returns the change (negative = refund).

    None when there is nothing to settle: settled already, or out of the window.
    """
    state.expire(now)
    reservation = state.reservations.pop(request_id, None)
    if reservation is None:
        return None
    second, reserved = reservation
    delta = num_tokens_actual - reserved
    bucket = state.buckets.get(second)
    if bucket is not None:
        bucket[0] = max(0, bucket[0] + delta)
    return delta


def release(state: WindowState, request_id: str, now: float) -> None:
    """A request that never ran (refused after admission, or cancelled while queued)."""
    state.expire(now)
    reservation = state.reservations.pop(request_id, None)
    if reservation is None:
        return
    second, reserved = reservation
    bucket = state.buckets.get(second)
    if bucket is not None:
        bucket[0] = max(0, bucket[0] - reserved)
        bucket[1] = max(0, bucket[1] - 1)


def _retry_after(state: WindowState, num_tokens: int, limits: Limits, now: float) -> float:
    """Seconds until enough of the window has slid out for this request to fit."""
    tokens, requests = state.used()
    for second in sorted(state.buckets):
        bucket_tokens, bucket_requests = state.buckets[second]
        tokens -= bucket_tokens
        requests -= bucket_requests
        if tokens + num_tokens <= limits.tpm and requests + 1 <= limits.rpm:
            return max(0.001, second + WINDOW_S - now)
    return float(WINDOW_S)
