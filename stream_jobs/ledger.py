"""One request id, one run: what the job remembers of each request id, per tenant. Pure.

# admitted --> ADMITTED --> forwarded to a worker --> FORWARDED
# its UsageEvent (ok, cancelled, failed; never a refusal) --> DONE, with its last seq
# the same (tenant, request_id) produced again --> judge() --> Verdict

Producers retry, and the bundled broker has no idempotent producers, so the same
request can arrive twice. Entries live in a changelog-backed table keyed
``tenant/request_id`` (``stream_jobs.app.TableLedger``), so they survive a job restart.
Every answer counts: a request refused (quota, rules, no worker) is DONE too, so its
producer sends a retry under a new id, and billing's key (tenant, session, request,
attempt) never holds a refusal and a run of one id. A producer the job could not
identify marks nothing. An entry is forgotten ``request_dedupe_s`` after its last
change.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any, Protocol


class State(StrEnum):
    ADMITTED = "admitted"
    """Charged and queued, not yet on a worker: a crash here must not lose it."""
    FORWARDED = "forwarded"
    DONE = "done"


@dataclass(frozen=True)
class Entry:
    state: State
    reply_to: str
    expires_at: float
    last_seq: int = 0

    def to_json(self) -> list[Any]:
        return [self.state.value, self.reply_to, self.expires_at, self.last_seq]

    @classmethod
    def from_json(cls, data: list[Any]) -> Entry:
        state, reply_to, expires_at, last_seq = data
        return cls(State(state), reply_to, float(expires_at), int(last_seq))


class Verdict(Enum):
    NEW = "new"
    RUN = "run"
    """Admitted before a restart but never forwarded: admit it again (its reservation
    is still in the window, so it is not charged twice)."""
    SAME_STREAM = "same_stream"
    """Running, and the copy asks for the same reply topic: its producer already gets
    the one stream; nothing more is sent."""
    DUPLICATE = "duplicate"
    """Finished, or running for another reply topic: answer ``duplicate_request``."""


def judge(entry: Entry | None, reply_to: str, now: float, *, in_memory: bool) -> Verdict:
    """What to do with a request whose id this tenant used before.

    ``in_memory``: this job instance holds the request right now (waiting or in flight).
    """
    if entry is None or entry.expires_at <= now:
        return Verdict.SAME_STREAM if in_memory else Verdict.NEW
    if entry.state is State.DONE:
        return Verdict.DUPLICATE
    if entry.state is State.ADMITTED and not in_memory:
        return Verdict.RUN
    return Verdict.SAME_STREAM if reply_to == entry.reply_to else Verdict.DUPLICATE


class Ledger(Protocol):
    """Entries keyed by (tenant, request_id); written only from the tenant's partition."""

    def get(self, tenant_id: str, request_id: str) -> Entry | None: ...

    def put(self, tenant_id: str, request_id: str, entry: Entry) -> None: ...

    def drop(self, tenant_id: str, request_id: str) -> None: ...

    def sweep(self, tenant_id: str, now: float) -> None:
        """Forgets the tenant's expired entries."""
        ...
