"""Which requests clients have cancelled, remembered briefly and boundedly.

A pure policy: the caller passes the clock. A cancel may reach a worker before the
request it names (the job forwards it later) or while the request waits for a slot,
so the worker notes every cancel for ``ttl_s`` and checks the book before and while
it serves a request. Entries are keyed by (tenant, request): a cancel from another
tenant never matches, even if it names the right request ID.
"""

from __future__ import annotations

from collections import OrderedDict


class CancelBook:
    def __init__(self, *, ttl_s: float = 300.0, max_entries: int = 100_000) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._noted: OrderedDict[tuple[str, str], float] = OrderedDict()  # -> noted at

    def note(self, tenant_id: str, request_id: str, now: float) -> None:
        key = (tenant_id, request_id)
        self._noted.pop(key, None)
        self._noted[key] = now
        self._expire(now)
        while len(self._noted) > self._max_entries:
            self._noted.popitem(last=False)  # the oldest goes first: it matters least

    def is_cancelled(self, tenant_id: str, request_id: str, now: float) -> bool:
        noted = self._noted.get((tenant_id, request_id))
        return noted is not None and now - noted < self._ttl_s

    def __len__(self) -> int:
        return len(self._noted)

    def _expire(self, now: float) -> None:
        while self._noted:
            key, noted = next(iter(self._noted.items()))
            if now - noted < self._ttl_s:
                return
            del self._noted[key]
