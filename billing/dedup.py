"""Which events of a batch are new attempts, and the token that makes their insert idempotent.

An attempt is identified by ``(tenant_id, session_id, request_id, attempt)``, the sort
key of ``usage_events``. Copies of one attempt reach the sink when Kafka redelivers a
batch after a crash, when a group's offsets are reset and the topic replayed, and when a
worker that crashed after reporting serves a request again. The first copy to reach
ClickHouse is the one billed; later ones are dropped here, before the insert, because
the rollups add up whatever is inserted and only a merge, not a plain read, drops a copy.

A request is billed for one run. Two attempts of it both run to their end only when
the job presumed a worker lost that was merely slow: it sent the request again, and the
first worker finished before the ``reassigned`` cancel reached it. The client heard one
stream (it takes each ``seq`` once), so the run reported second is *superseded*: stored,
with its cost in ``cost_units`` (the fleet did the work), but billed nothing and flagged
``superseded`` (``later_runs``). Both attempts' records are keyed by tenant, so they reach
one partition, in one order, on every replay: the same attempt is billed each time. The
job's budgets settle by the same rule (``stream_jobs.budgets.settle``).

Pure except ``write_usage``, which runs the same steps as the sink, synchronously and
without retries, for seeding data and for benchmarks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple, Protocol, cast

import msgspec

from billing.rows import USAGE_COLUMNS, usage_columns
from billing.usage_codec import Usage, UsageRecord
from schemas import UsageStatus
from tokenbus.pricing import Pricer

UsageKey = tuple[str, str, str, int]
"""(tenant_id, session_id, request_id, attempt)."""
Attempt = tuple[UsageKey, datetime]
"""An attempt's key and its ``created_at``."""
RequestKey = tuple[str, str, str]
"""(tenant_id, session_id, request_id): a request, over all its attempts."""
SUPERSEDED = "superseded"
"""Flag of a run stored but not billed: another attempt of its request was (``later_runs``)."""


class Stored(NamedTuple):
    """What ClickHouse holds of the requests of some attempts (``KeyedStore.look_up``)."""

    keys: set[UsageKey]
    """The attempts asked about that are stored."""
    billed: set[RequestKey]
    """Their requests that have a billed run stored: an attempt neither rejected nor
    superseded."""


class KeyedStore(Protocol):
    def look_up(self, keys: Sequence[UsageKey]) -> Stored: ...

    def insert_columns(self, columns: Sequence[Sequence[Any]], *, dedup_token: str) -> None: ...


def usage_key(event: Usage) -> UsageKey:
    return (event.tenant_id, event.session_id, event.request_id, event.attempt)


def first_copies(events: Iterable[Usage]) -> list[Usage]:
    """The first event of each key, in order; the batch's own repeats are dropped."""
    return [event for _, event in keyed_first_copies(events)]


def keyed_first_copies(events: Iterable[Usage]) -> list[tuple[UsageKey, Usage]]:
    """``first_copies``, each with its key."""
    events = list(events)
    keys = [(e.tenant_id, e.session_id, e.request_id, e.attempt) for e in events]
    if len(set(keys)) == len(keys):  # no repeats, as in almost every batch
        return list(zip(keys, events, strict=True))
    kept: dict[UsageKey, Usage] = {}
    for key, event in zip(keys, events, strict=True):
        kept.setdefault(key, event)
    return list(kept.items())


@dataclass(frozen=True)
class ColumnPlan:
    """The new attempts of a batch, priced, by column: what the sink inserts."""

    columns: list[Sequence[Any]]
    """``usage_columns`` of the new attempts."""
    dedup_token: str
    """Same keys, same token: a retried insert is dropped by ClickHouse if the first landed."""
    num_known: int
    """Events left out because ClickHouse already holds their attempt."""
    keys: list[UsageKey]
    """The attempts the columns hold, in row order."""
    created_ticks: list[int]
    """Their ``created_at``, in DateTime64(3) ticks: the ``created_at`` column."""

    @property
    def num_rows(self) -> int:
        return len(self.keys)


def plan_keyed_columns(
    keyed: Sequence[tuple[UsageKey, Usage]],
    existing: set[UsageKey],
    pricer: Pricer,
    billed: set[RequestKey] | frozenset[RequestKey] = frozenset(),
) -> ColumnPlan:
    """The plan of the first copies ``keyed`` (with their keys) whose key is not in
    ``existing``; runs of a request in ``billed`` (or billed earlier in ``keyed``) are
    superseded (``later_runs``)."""
    new = [item for item in keyed if item[0] not in existing] if existing else keyed
    keys = [key for key, _ in new]
    events = [event for _, event in new]
    charges = pricer.charge_nanos_each(events)
    for index in later_runs(new, billed):
        events[index] = superseded(events[index])
        weight, cost, _, version = charges[index]
        charges[index] = (weight, cost, 0, version)
    columns = usage_columns(events, charges)
    return ColumnPlan(
        columns,
        dedup_token(keys),
        len(keyed) - len(new),
        keys,
        cast(list[int], columns[_CREATED_AT]),
    )


_CREATED_AT = USAGE_COLUMNS.index("created_at")
_ATTEMPT = itemgetter(3)
_EVENT = itemgetter(1)
_ATTEMPT_OF = attrgetter("attempt")


def is_resent(keys: Iterable[UsageKey]) -> bool:
    """Some attempt is a request's second or later: its request may have another run."""
    return any(map(_ATTEMPT, keys))


def any_resent(keyed: Iterable[tuple[UsageKey, Usage]]) -> bool:
    """``is_resent`` of keyed events, in C loops: asked of every batch."""
    return any(map(_ATTEMPT_OF, map(_EVENT, keyed)))


def later_runs(
    keyed: Sequence[tuple[UsageKey, Usage]], billed: Collection[RequestKey] = frozenset()
) -> list[int]:
    """The positions in ``keyed`` (new attempts, in the order the topic holds them) of the
    runs to supersede: a run (an attempt not rejected) of a request that is in ``billed``
    or has an earlier run in ``keyed``. Two runs of a request need a second attempt, so a
    batch of first attempts alone, with nothing billed, is answered at once."""
    if not billed and not any_resent(keyed):
        return []
    seen: set[RequestKey] = set(billed)
    later: list[int] = []
    for index, (key, event) in enumerate(keyed):
        if event.status is UsageStatus.REJECTED:
            continue  # refused before it ran: nothing was streamed, nothing is billed
        request = (key[0], key[1], key[2])
        if request in seen:
            later.append(index)
        else:
            seen.add(request)
    return later


def superseded(event: Usage) -> Usage:
    """``event`` flagged ``SUPERSEDED``."""
    flags = event.flags if SUPERSEDED in event.flags else [*event.flags, SUPERSEDED]
    if isinstance(event, UsageRecord):
        return msgspec.structs.replace(event, flags=flags)
    return event.model_copy(update={"flags": flags})


def dedup_token(keys: Iterable[UsageKey]) -> str:
    """A digest of the keys, independent of their order."""
    # Each key as "tenant\x1fsession\x1frequest\x1fattempt\x1e"; sorting the texts, not
    # the tuples, makes the order; one call digests them all.
    text = "".join(sorted([f"{t}\x1f{s}\x1f{r}\x1f{a}\x1e" for t, s, r, a in keys]))
    return f"usage-{hashlib.sha256(text.encode()).hexdigest()}"


def write_usage(store: KeyedStore, events: Iterable[Usage], pricer: Pricer) -> ColumnPlan:
    """Inserts the new attempts among ``events``, by the sink's own plan, in one go."""
    keyed = keyed_first_copies(events)
    stored = store.look_up([key for key, _ in keyed]) if keyed else Stored(set(), set())
    plan = plan_keyed_columns(keyed, stored.keys, pricer, stored.billed)
    if plan.num_rows:
        store.insert_columns(plan.columns, dedup_token=plan.dedup_token)
    return plan
