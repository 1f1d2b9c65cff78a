"""One request id, one run: what the job remembers of each request id, per tenant. Pure.

# admitted --> ADMITTED --> forwarded to a worker --> FORWARDED
# its UsageEvent (ok, cancelled, failed; never a refusal) --> DONE, with its last seq
# the same (tenant, request_id) produced again --> judge() --> Verdict
# a job (re)started, or given partitions --> FORWARDED entries --> adopted (Forward)

Producers retry, and the bundled broker has no idempotent producers, so the same
request can arrive twice. Entries live in a changelog-backed table keyed
``tenant/request_id`` (``stream_jobs.app.TableLedger``), so they survive a job restart.
Every answer counts: a request refused (quota, rules, no worker) is DONE too, so its
producer sends a retry under a new id, and billing's key (tenant, session, request,
attempt) never holds a refusal and a run of one id. A producer the job could not
identify marks nothing. An entry is forgotten ``request_dedupe_s`` after its last
change.

A FORWARDED entry says where the request runs (``Forward``): the record the job
forwarded, on its worker's topic, which holds the copy the worker runs. The job keeps
its requests in flight in memory, and a job that restarts (or that is given another
instance's partitions) would otherwise not know them: were their worker lost later, no
one would send them again. So the job adopts every FORWARDED entry of the partitions it
is given, reading the forwarded copies back, and watches their worker runs as its own.
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
class Forward:
    """Where a forwarded request runs: the record the job produced on its worker's topic
    (``topic``, ``partition``, ``offset``), and ``home``, the partition of the tenant's
    requests, whose changelog partition holds the entry."""

    home: int
    topic: str
    partition: int
    offset: int

    @property
    def place(self) -> tuple[str, int, int]:
        """The forwarded record's (topic, partition, offset)."""
        return (self.topic, self.partition, self.offset)

    def to_json(self) -> list[Any]:
        return [self.home, self.topic, self.partition, self.offset]

    @classmethod
    def from_json(cls, data: list[Any]) -> Forward:
        home, topic, partition, offset = data
        return cls(int(home), str(topic), int(partition), int(offset))


@dataclass(frozen=True)
class Entry:
    state: State
    reply_to: str
    expires_at: float
    last_seq: int = 0
    forward: Forward | None = None
    """Set while FORWARDED: where the request runs."""

    def to_json(self) -> list[Any]:
        data = [self.state.value, self.reply_to, self.expires_at, self.last_seq]
        return data if self.forward is None else [*data, self.forward.to_json()]

    @classmethod
    def from_json(cls, data: list[Any]) -> Entry:
        state, reply_to, expires_at, last_seq, *rest = data
        forward = Forward.from_json(rest[0]) if rest and rest[0] is not None else None
        return cls(State(state), reply_to, float(expires_at), int(last_seq), forward)


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

    def put(self, tenant_id: str, request_id: str, entry: Entry) -> None:
        """Written on the partition of the event being handled (the tenant's)."""
        ...

    def put_at(self, home: int, tenant_id: str, request_id: str, entry: Entry) -> None:
        """Written on partition ``home`` (the tenant's): for writes outside its events."""
        ...

    async def put_durably(
        self, home: int | None, tenant_id: str, request_id: str, entry: Entry
    ) -> None:
        """``put`` (``home`` None) or ``put_at``, returning once the broker holds it."""
        ...

    def drop(self, tenant_id: str, request_id: str) -> None: ...

    def sweep(self, tenant_id: str, now: float) -> None:
        """Forgets the tenant's expired entries."""
        ...

    def forwarded(self, homes: set[int], now: float) -> list[tuple[str, str, Entry]]:
        """(tenant, request_id, entry) of each live FORWARDED entry whose ``home`` is
        one of ``homes``: the requests running for those partitions."""
        ...
