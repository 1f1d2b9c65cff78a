"""Session affinity: the worker that served a session's last turn, so that its next
turn can return there and find its history in vLLM's prefix cache.

A bounded LRU over plain data, keyed by (tenant, session): tenant first, so one
tenant's session ids never name another's. The routing policy decides whether to
return (``routing.choose``'s ``previous``); this only remembers. A lost worker's
sessions are forgotten at once, so no turn is steered to a run that is gone.
"""

from __future__ import annotations

from collections import OrderedDict

Session = tuple[str, str]
"""(tenant_id, session_id)"""


class SessionAffinity:
    def __init__(self, max_sessions: int) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self._max = max_sessions
        self._last: OrderedDict[Session, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def previous(self, session: Session) -> str | None:
        """The worker of the session's last turn, if remembered."""
        return self._last.get(session)

    def note(self, session: Session, worker_id: str) -> None:
        """The session's turn went to ``worker_id``; the least recent beyond the bound
        is forgotten."""
        self._last[session] = worker_id
        self._last.move_to_end(session)
        if len(self._last) > self._max:
            self._last.popitem(last=False)

    def forget_worker(self, worker_id: str) -> int:
        """Forgets every session of a lost worker; returns how many."""
        gone = [session for session, worker in self._last.items() if worker == worker_id]
        for session in gone:
            del self._last[session]
        return len(gone)
