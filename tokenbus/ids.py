"""Identifiers: ``sess_``/``req_`` + ULID.

ULIDs carry 80 random bits, so they are unguessable, but tokenbus never treats an ID as
a capability: every lookup is also checked against the caller's tenant.
"""

from __future__ import annotations

import os
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
