"""Session IDs that prove which tenant they were issued to, with no shared state.

A session ID is ``sess_`` + a ULID (48 bits of milliseconds, 80 more bits). Here the
80 bits are 40 random bits and a 40-bit HMAC of (tenant, time, random) under the
bridge's session secret. Any bridge instance with the same secret can tell whether
an ``X-Session-ID`` was issued to the caller's tenant, across restarts and scale-out,
without a lookup table. The ID is still unguessable (80 bits unknown to anyone
without the secret), and it is never a capability: a session ID only groups usage.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from tokenbus.ids import is_session_id

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DECODE = {c: i for i, c in enumerate(_CROCKFORD)}
_MASK40 = (1 << 40) - 1


def _encode(value: int) -> str:
    return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


def _decode(body: str) -> int:
    value = 0
    for ch in body:
        value = (value << 5) | _DECODE[ch]
    return value


class SessionIssuer:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the session secret needs at least 16 bytes")
        self._secret = secret

    @classmethod
    def create(cls, secret: str | None) -> SessionIssuer:
        """Unset secret: a random one, so sessions survive only this process."""
        return cls(secret.encode() if secret else os.urandom(32))

    def issue(self, tenant_id: str, now_ms: int | None = None) -> str:
        ms = int(time.time() * 1000) if now_ms is None else now_ms
        nonce = int.from_bytes(os.urandom(5), "big")
        value = (ms << 80) | (nonce << 40) | self._mac(tenant_id, ms, nonce)
        return f"sess_{_encode(value)}"

    def owned_by(self, session_id: str, tenant_id: str) -> bool:
        if not is_session_id(session_id):
            return False
        value = _decode(session_id.removeprefix("sess_"))
        ms, nonce, mac = value >> 80, (value >> 40) & _MASK40, value & _MASK40
        return hmac.compare_digest(
            mac.to_bytes(5, "big"), self._mac(tenant_id, ms, nonce).to_bytes(5, "big")
        )

    def resolve(self, requested: str | None, tenant_id: str) -> str:
        """The client's session if its tenant owns it, else a new one for the tenant."""
        if requested and self.owned_by(requested, tenant_id):
            return requested
        return self.issue(tenant_id)

    def _mac(self, tenant_id: str, ms: int, nonce: int) -> int:
        message = f"{tenant_id}\x00{ms}\x00{nonce}".encode()
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()
        return int.from_bytes(digest[:5], "big")
