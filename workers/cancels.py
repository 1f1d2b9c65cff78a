"""Which requests clients have cancelled, remembered briefly and boundedly.

A pure policy: the caller passes the clock. A cancel may reach a worker before the
request it names (the job forwards it later) or while the request waits for a slot,
so the worker notes every cancel for ``ttl_s`` and checks the book before and while
it serves a request. Entries are keyed by (tenant, request, attempt): a cancel from
another tenant never matches, even if it names the right request ID, and a cancel of
one attempt (the dispatcher's ``reassigned``) leaves the next attempt alone. A cancel
with no attempt applies to every attempt.
"""

from __future__ import annotations

from collections import OrderedDict

_Key = tuple[str, str, int | None]


class CancelBook:
    def __init__(self, *, ttl_s: float = 300.0, max_entries: int = 100_000) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._noted: OrderedDict[_Key, tuple[float, str]] = OrderedDict()  # -> (at, reason)

    def note(
        self,
        tenant_id: str,
        request_id: str,
        now: float,
        *,
        attempt: int | None = None,
        reason: str = "client_cancelled",
    ) -> None:
        key = (tenant_id, request_id, attempt)
        self._noted.pop(key, None)
        self._noted[key] = (now, reason)
        self._expire(now)
        while len(self._noted) > self._max_entries:
            self._noted.popitem(last=False)  # the oldest goes first: it matters least

    def reason(self, tenant_id: str, request_id: str, attempt: int, now: float) -> str | None:
        """Why this attempt is cancelled, or None when it is not."""
        if not self._noted:
            return None  # the common case, asked at every engine step of every request
        for key in ((tenant_id, request_id, attempt), (tenant_id, request_id, None)):
            entry = self._noted.get(key)
            if entry is not None and now - entry[0] < self._ttl_s:
                return entry[1]
        return None

    def is_cancelled(self, tenant_id: str, request_id: str, now: float, attempt: int = 0) -> bool:
        return self.reason(tenant_id, request_id, attempt, now) is not None

    def __len__(self) -> int:
        return len(self._noted)

    def _expire(self, now: float) -> None:
        while self._noted:
            key, (noted, _) = next(iter(self._noted.items()))
            if now - noted < self._ttl_s:
                return
            del self._noted[key]
