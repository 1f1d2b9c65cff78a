"""One request id, one run: what the job remembers of each request id, per tenant. Pure.

# admitted --> (held in the job, nothing written) --> forwarded to a worker --> FORWARDED
# a copy taken while it is held --> ADMITTED, with the copy counted
# its UsageEvent (ok, cancelled, failed; never a refusal) --> DONE, with its last seq
# the same (tenant, request_id) produced again --> judge() --> Verdict
# a copy taken while it ran (SAME_STREAM) --> counted (with_copy) --> answered when it ends
# a job (re)started, or given partitions --> FORWARDED entries --> adopted (Forward)
# a job (re)started, or given partitions --> every entry's reservation --> quota windows

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

The quota windows are kept here too: each entry carries its request's reservation
(``Reserved``), and only here, so a request's run costs the ledger's records and no
others. An admitted request has no record until its forward, and none is needed: its
event is redelivered after a crash, and admitted again. A worker's refusal (a
``rejected`` UsageEvent) settles the window in memory but writes no entry, so a job
restarted within the minute counts that request's estimate, not its real count.

Every copy is answered. A copy of a running request that names the same reply topic
is counted in its entry (``with_copy``, up to ``MAX_COPIES``), and answered
``duplicate_request`` after the stream, when the job learns that the request ended
(``ended``). The job cannot tell a copy sent while the stream ran from one sent just
after its last chunk (the worker writes that chunk; the job hears of the end a moment
later, from its UsageEvent), and the second must not go unanswered. Every answer after
the stream takes the next seq (``last_seq`` counts them), so a reply topic never holds
one seq twice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum, StrEnum
from typing import Any, Protocol

MAX_COPIES = 64
"""Copies of one running request answered after its stream. A producer's retries make a
few; more is a flood, which the job dead-letters rather than answer (each copy answered
is a ledger write now and a chunk later, and costs its producer no quota)."""


class State(StrEnum):
    ADMITTED = "admitted"
    """Charged and queued, not yet on a worker. Written only to count a copy taken
    meanwhile: an admitted request is held in the job, its event unacked, until its
    forward, so a crash here has it redelivered; the ledger's first record of it is
    FORWARDED."""
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
class Reserved:
    """A request's reservation in its quota window, as it stood when its entry was
    written: the window (``window.window_key``: the tenant's, or its batch lines') and the
    reservation's ``[bucket, tokens, settled]`` (``window.Reservations``). The ledger is
    where the windows are kept: a job restarted, or given another instance's partitions,
    rebuilds each window from the reservations of its tenants' entries."""

    window: str
    bucket: int
    tokens: int
    settled: int

    @property
    def reservation(self) -> list[int]:
        return [self.bucket, self.tokens, self.settled]

    def to_json(self) -> list[Any]:
        return [self.window, self.bucket, self.tokens, self.settled]

    @classmethod
    def from_json(cls, data: list[Any]) -> Reserved:
        window, bucket, tokens, settled = data
        return cls(str(window), int(bucket), int(tokens), int(settled))


@dataclass(frozen=True)
class Entry:
    state: State
    reply_to: str
    expires_at: float
    last_seq: int = 0
    forward: Forward | None = None
    """Set while FORWARDED: where the request runs."""
    copies: int = 0
    """Copies taken while it ran (ADMITTED or FORWARDED), each owed a ``duplicate_request``
    answer after the stream. Always 0 once DONE: ``ended`` says which answers they are owed."""
    reserved: Reserved | None = None
    """Its quota reservation: while ADMITTED or FORWARDED the estimate charged, once DONE
    after a run the settled count; None for a request answered without running (its
    reservation was given back, or never made)."""

    def to_json(self) -> list[Any]:
        data = [self.state.value, self.reply_to, self.expires_at, self.last_seq]
        forward = None if self.forward is None else self.forward.to_json()
        if self.reserved is not None:
            return [*data, forward, self.copies, self.reserved.to_json()]
        if self.copies:
            return [*data, forward, self.copies]
        return data if forward is None else [*data, forward]

    @classmethod
    def from_json(cls, data: list[Any]) -> Entry:
        state, reply_to, expires_at, last_seq, *rest = data
        forward = Forward.from_json(rest[0]) if rest and rest[0] is not None else None
        copies = int(rest[1]) if len(rest) > 1 else 0
        reserved = Reserved.from_json(rest[2]) if len(rest) > 2 else None
        return cls(
            State(state), reply_to, float(expires_at), int(last_seq), forward, copies, reserved
        )

    def with_copy(self) -> Entry:
        """This entry, with one more copy owed its answer (a SAME_STREAM verdict)."""
        return replace(self, copies=self.copies + 1)

    def answered_once_more(self) -> Entry:
        """A DONE entry after one more ``duplicate_request`` answer, at ``last_seq + 1``."""
        return replace(self, last_seq=self.last_seq + 1)


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


def carried(previous: Entry | None, entry: Entry) -> Entry:
    """``entry`` (ADMITTED or FORWARDED) in place of ``previous``: the copies owed an
    answer are still owed."""
    if previous is None or previous.state is State.DONE:
        return entry
    return replace(entry, copies=previous.copies)


def ended(previous: Entry | None, entry: Entry) -> tuple[Entry, range]:
    """The DONE ``entry`` of a request whose answer ended at ``entry.last_seq``, in place
    of ``previous``; and the seqs of the ``duplicate_request`` answers owed to the copies
    taken while it ran, one each, after that answer. Settled twice (a refusal's entry is
    written before its answer and again after it): nothing more is owed, and no seq
    already answered is taken back."""
    assert entry.state is State.DONE
    if previous is not None and previous.state is State.DONE:
        last_seq = max(previous.last_seq, entry.last_seq)
        return replace(entry, last_seq=last_seq, copies=0), range(0)
    copies = 0 if previous is None else previous.copies
    owed = range(entry.last_seq + 1, entry.last_seq + 1 + copies)
    return replace(entry, last_seq=entry.last_seq + copies, copies=0), owed


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
