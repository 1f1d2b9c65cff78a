from __future__ import annotations

import pytest

from bridge.throttle import KeyThrottle


def test_burst_then_refill_at_rate() -> None:
    throttle = KeyThrottle(rate_per_s=100, burst=100)
    decisions = [throttle.take("k", now=10.0) for _ in range(101)]
    assert all(d.allowed for d in decisions[:100])
    refused = decisions[100]
    assert not refused.allowed
    assert refused.retry_after_s == pytest.approx(0.01)
    assert throttle.take("k", now=10.0 + refused.retry_after_s).allowed


def test_sustained_rate_is_held() -> None:
    throttle = KeyThrottle(rate_per_s=100, burst=100)
    allowed = sum(throttle.take("k", now=i * 0.001).allowed for i in range(2000))  # 1000/s, 2 s
    assert 290 <= allowed <= 310  # the burst of 100, then 100/s for 2 s


def test_keys_are_independent() -> None:
    throttle = KeyThrottle(rate_per_s=1, burst=1)
    assert throttle.take("a", now=0).allowed
    assert not throttle.take("a", now=0).allowed
    assert throttle.take("b", now=0).allowed


def test_memory_is_bounded_by_max_keys() -> None:
    throttle = KeyThrottle(rate_per_s=1, burst=1, max_keys=3)
    for key in "abcde":
        throttle.take(key, now=0)
    assert len(throttle._buckets) == 3
    assert throttle.take("a", now=0).allowed  # evicted, so it starts with a full bucket


def test_rejects_nonsense_limits() -> None:
    with pytest.raises(ValueError):
        KeyThrottle(rate_per_s=0, burst=1)
