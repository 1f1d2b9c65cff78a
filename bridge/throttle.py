"""Per-key request throttle: a token bucket per API key (or token), pure and bounded.

The caller passes the clock. Each key refills at ``rate_per_s`` up to ``burst``; a
request takes one. Only authenticated keys are tracked, and at most ``max_keys`` of
them (least recently used go first), so a flood of tokens cannot grow memory.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class ThrottleDecision:
    allowed: bool
    remaining: int
    retry_after_s: float
    limit: int


class KeyThrottle:
    def __init__(self, rate_per_s: float, burst: int, *, max_keys: int = 100_000) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self._rate = rate_per_s
        self._burst = burst
        self._max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # -> (level, at)

    def take(self, key: str, now: float) -> ThrottleDecision:
        level, at = self._buckets.pop(key, (float(self._burst), now))
        level = min(float(self._burst), level + (now - at) * self._rate)
        allowed = level >= 1.0 - 1e-9  # float refill must not miss by a rounding error
        if allowed:
            level -= 1.0
        self._buckets[key] = (level, now)
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        retry = 0.0 if allowed else (1.0 - level) / self._rate
        return ThrottleDecision(allowed, int(level), retry, self._burst)
