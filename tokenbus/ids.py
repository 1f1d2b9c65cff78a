"""Identifiers: ``sess_``/``req_`` + ULID outside, time-ordered 64-bit integers inside.

ULIDs carry 80 random bits, so they are unguessable, but tokenbus never treats an ID as
a capability: every lookup is also checked against the caller's tenant.
"""

from __future__ import annotations

import os
import threading
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def ulid(now_ms: int | None = None) -> str:
    """A 26-character ULID: 48 bits of milliseconds, then 80 random bits."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


def new_session_id() -> str:
    return f"sess_{ulid()}"


def new_request_id() -> str:
    return f"req_{ulid()}"


def is_session_id(value: str) -> bool:
    body = value.removeprefix("sess_")
    return value.startswith("sess_") and len(body) == 26 and all(c in _CROCKFORD for c in body)


class SnowflakeIds:
    """Time-ordered 64-bit IDs for internal keys: 41 bits ms, 10 bits node, 12 bits seq."""

    EPOCH_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z

    def __init__(self, node: int) -> None:
        if not 0 <= node < 1024:
            raise ValueError(f"node must be in [0, 1024), got {node}")
        self._node = node
        self._last_ms = -1
        self._seq = 0
        self._lock = threading.Lock()

    def next_id(self) -> int:
        with self._lock:
            ms = int(time.time() * 1000) - self.EPOCH_MS
            if ms < self._last_ms:  # the clock stepped back: stay monotonic
                ms = self._last_ms
            if ms == self._last_ms:
                self._seq = (self._seq + 1) & 0xFFF
                if self._seq == 0:
                    ms += 1  # 4096 in one ms: borrow the next one
            else:
                self._seq = 0
            self._last_ms = ms
            return (ms << 22) | (self._node << 12) | self._seq
