"""Spend budgets: the token window's machinery in cost units, over calendar periods.

A pure policy over a ``SpendStore``; the Faust job's store is a changelog-backed table
(``stream_jobs.app.TableSpendStore``), so a restarted job resumes with the same spend.

- ``reserve`` charges a request's maximum cost (``max_cost_nanos``: its prompt plus
  ``max_tokens``, priced as billing prices) to every budget that applies to it, and
  refuses it, charging nothing, if that would take any hard budget past its limit;
- ``settle`` replaces the reservation by the billed cost (``billed_nanos``: the very
  ``billed_units`` the sink writes to ClickHouse), in the buckets it was reserved in;
- ``release`` gives back the reservation of a request that never ran.

Amounts are integer nano-units, the scale of ``billed_units``: a bucket's settled spend
is a sum of exactly the values ClickHouse sums. Each counter keeps two sums: ``held``
(settled spend plus open reservations: what admission checks) and ``settled`` (what
alerts and reconciliation read).

A bucket is where spend is kept: the period itself for a calendar day, week or month in
the budget's zone (named by its first day), or one hour for ``rolling:Nh``, which counts
the last N + 1 hour buckets: never less than the last N hours, at most one hour more.
Spend is kept in the bucket of the request's admission, the instant billing prices by
(``UsageEvent.created_at``), even when it settles after the period ended.

A token's balance (the JWT claim ``quota_balance``, in cost units) is one more budget,
``token_budget``: hard, keyed by the credential's hash as a key budget is, over the
``total`` period (one bucket, the token's whole life); it binds with the tenant's.
"""

from __future__ import annotations

import calendar
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any, Protocol
from zoneinfo import ZoneInfo

from schemas import FinishReason, UsageEvent, WorkItem
from tokenbus.budget_config import BudgetConfig
from tokenbus.pricing import Pricer
from tokenbus.usage import usage_of

NANOS = 10**9
"""Nano-units per cost unit: ``billed_units`` carries nine decimals."""


def to_nanos(units: Decimal) -> int:
    return int(units.scaleb(9).to_integral_value())


def to_units(nanos: int) -> Decimal:
    return Decimal(nanos).scaleb(-9)


TOTAL_BOUNDS = (datetime(1970, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC))
"""The instants the ``total`` period spans: every instant billing stores."""


@dataclass(frozen=True)
class Period:
    """``day``, ``week`` (from Monday), ``month`` in ``tz``, ``rolling`` ``hours``, or
    ``total`` (one bucket that never turns: a token's balance)."""

    kind: str
    tz: str = "UTC"
    hours: int = 0
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_zone", ZoneInfo(self.tz))

    @classmethod
    def parse(cls, spec: str, tz: str = "UTC") -> Period:
        if spec.startswith("rolling:") and spec.endswith("h"):
            return cls("rolling", "UTC", int(spec[len("rolling:") : -1]))
        if spec == "total":
            return cls("total")
        if spec not in ("day", "week", "month"):
            raise ValueError(f"period {spec!r}: want day, week, month, rolling:<N>h or total")
        return cls(spec, tz)

    def bucket_of(self, at: datetime) -> str:
        """Where spend made at ``at`` is kept."""
        if self.kind == "total":
            return "total"
        if self.kind == "rolling":
            return str(int(at.timestamp() // 3600))
        local = at.astimezone(self._zone).date()
        if self.kind == "week":
            local -= timedelta(days=local.weekday())
        elif self.kind == "month":
            local = local.replace(day=1)
        return local.isoformat()

    def counted(self, at: datetime) -> list[str]:
        """The buckets whose spend counts against the budget at ``at``."""
        if self.kind != "rolling":
            return [self.bucket_of(at)]
        hour = int(at.timestamp() // 3600)
        return [str(hour - i) for i in range(self.hours + 1)]

    def bounds(self, bucket: str) -> tuple[datetime, datetime]:
        """The bucket's instants [start, end), in UTC: what a billing query sums over."""
        if self.kind == "total":
            return TOTAL_BOUNDS
        if self.kind == "rolling":
            start = datetime.fromtimestamp(int(bucket) * 3600, UTC)
            return start, start + timedelta(hours=1)
        first = date.fromisoformat(bucket)
        if self.kind == "day":
            last = first + timedelta(days=1)
        elif self.kind == "week":
            last = first + timedelta(days=7)
        else:
            last = first + timedelta(days=calendar.monthrange(first.year, first.month)[1])
        # Local midnights (ZoneInfo resolves a shifted one), then UTC.
        start = datetime(first.year, first.month, first.day, tzinfo=self._zone)
        end = datetime(last.year, last.month, last.day, tzinfo=self._zone)
        return start.astimezone(UTC), end.astimezone(UTC)

    def resets_at(self, at: datetime) -> datetime | None:
        """When spend made by ``at`` no longer counts (rolling: at the latest); never
        for ``total``."""
        if self.kind == "total":
            return None
        if self.kind == "rolling":
            return self.bounds(self.bucket_of(at))[1] + timedelta(hours=self.hours)
        return self.bounds(self.bucket_of(at))[1]


@dataclass(frozen=True)
class Subject:
    """Who a request's spend is charged to: every budget naming one of these applies."""

    tenant_id: str
    model: str
    key_sha256: str | None = None

    @property
    def entities(self) -> frozenset[str]:
        names = {
            f"tenant:{self.tenant_id}",
            f"model:{self.model}",
            f"tenant_model:{self.tenant_id}/{self.model}",
        }
        if self.key_sha256:
            names.add(f"key:{self.key_sha256}")
        return frozenset(names)


@dataclass(frozen=True)
class Budget:
    budget_id: str
    entity: str
    num_limit_nanos: int
    period: Period
    hard: bool = True
    thresholds: tuple[int, ...] = (50, 80, 95, 100)

    @classmethod
    def from_config(cls, config: BudgetConfig, default_tz: str = "UTC") -> Budget:
        return cls(
            budget_id=config.budget_id(default_tz),
            entity=config.entity,
            num_limit_nanos=to_nanos(config.limit),
            period=Period.parse(config.period, config.tz or default_tz),
            hard=config.enforce == "hard",
            thresholds=config.thresholds,
        )


def token_budget(credential_sha256: str, balance: Decimal) -> Budget:
    """A token's balance as its own hard budget, keyed by the credential's hash (as a
    key budget is) over the token's life. It does not alert (no thresholds): whoever
    minted the token set the balance. Both it and the tenant's budgets bind, so the
    smaller remainder refuses first: the claim narrows the tenant's budget for that
    token, and never widens it."""
    return Budget(
        budget_id=f"key:{credential_sha256}|total",
        entity=f"key:{credential_sha256}",
        num_limit_nanos=to_nanos(balance),
        period=Period("total"),
        thresholds=(),
    )


class BudgetBook:
    """Every budget, by id: the tenants file's, then runtime changes (``put``)."""

    def __init__(self, budgets: Iterable[Budget] = ()) -> None:
        self._budgets = {b.budget_id: b for b in budgets}

    def put(self, budget_id: str, budget: Budget | None) -> None:
        if budget is None:
            self._budgets.pop(budget_id, None)
        else:
            self._budgets[budget_id] = budget

    def get(self, budget_id: str) -> Budget | None:
        return self._budgets.get(budget_id)

    def applicable(self, subject: Subject) -> list[Budget]:
        """All of them, not only the most specific: a key's budget and its tenant's both
        bind, and the smaller one refuses first."""
        entities = subject.entities
        return [b for b in self._budgets.values() if b.entity in entities]

    def __iter__(self) -> Iterator[Budget]:
        return iter(list(self._budgets.values()))

    def __len__(self) -> int:
        return len(self._budgets)


@dataclass(frozen=True)
class Reservation:
    num_nanos: int
    """Reserved, then (once settled) billed: the sum of the settled attempts' costs."""
    counters: tuple[tuple[str, str], ...]
    """(budget_id, bucket) charged, so settling changes exactly those."""
    attempts: tuple[int, ...] = ()
    """Attempts settled (each has its billing row); none: still reserved."""
    expires_at: float = 0.0
    """A settled reservation is kept until then, so a redelivered UsageEvent is known."""

    @property
    def settled(self) -> bool:
        return bool(self.attempts)

    def to_json(self) -> list[object]:
        counters = [list(c) for c in self.counters]
        return [self.num_nanos, counters, list(self.attempts), self.expires_at]

    @classmethod
    def from_json(cls, data: list[Any]) -> Reservation:
        num_nanos, counters, attempts, expires_at = data
        return cls(
            int(num_nanos),
            tuple((str(b), str(k)) for b, k in counters),
            tuple(int(a) for a in attempts),
            float(expires_at),
        )


class SpendStore(Protocol):
    """Spend per (budget, bucket) and reservations per (tenant, request). Written only
    from the agent of the tenant's partition; sums are over every tenant this store
    holds (a model's budget spans tenants)."""

    def spent(self, budget_id: str, bucket: str) -> tuple[int, int]:
        """(held, settled) nano-units."""
        ...

    def add(self, tenant_id: str, budget_id: str, bucket: str, held: int, settled: int) -> None: ...

    def reservation(self, tenant_id: str, request_id: str) -> Reservation | None: ...

    def put_reservation(
        self, tenant_id: str, request_id: str, reservation: Reservation | None
    ) -> None: ...

    def fired(self, budget_id: str, bucket: str) -> frozenset[int]: ...

    def fire(self, tenant_id: str, budget_id: str, bucket: str, threshold: int) -> None: ...

    def buckets(self) -> list[tuple[str, str, int, int]]:
        """Every (budget_id, bucket, held, settled) this store holds."""
        ...


class MemorySpendStore:
    def __init__(self) -> None:
        self.counters: dict[tuple[str, str, str], tuple[int, int]] = {}
        self.totals: dict[tuple[str, str], tuple[int, int]] = {}
        self.reservations: dict[tuple[str, str], Reservation] = {}
        self.fired_marks: dict[tuple[str, str], set[int]] = {}

    def spent(self, budget_id: str, bucket: str) -> tuple[int, int]:
        return self.totals.get((budget_id, bucket), (0, 0))

    def add(self, tenant_id: str, budget_id: str, bucket: str, held: int, settled: int) -> None:
        key = (tenant_id, budget_id, bucket)
        old_held, old_settled = self.counters.get(key, (0, 0))
        self.counters[key] = (old_held + held, old_settled + settled)
        total_held, total_settled = self.totals.get((budget_id, bucket), (0, 0))
        self.totals[(budget_id, bucket)] = (total_held + held, total_settled + settled)

    def reservation(self, tenant_id: str, request_id: str) -> Reservation | None:
        return self.reservations.get((tenant_id, request_id))

    def put_reservation(
        self, tenant_id: str, request_id: str, reservation: Reservation | None
    ) -> None:
        if reservation is None:
            self.reservations.pop((tenant_id, request_id), None)
        else:
            self.reservations[(tenant_id, request_id)] = reservation

    def fired(self, budget_id: str, bucket: str) -> frozenset[int]:
        return frozenset(self.fired_marks.get((budget_id, bucket), ()))

    def fire(self, tenant_id: str, budget_id: str, bucket: str, threshold: int) -> None:
        self.fired_marks.setdefault((budget_id, bucket), set()).add(threshold)

    def buckets(self) -> list[tuple[str, str, int, int]]:
        return [(b, k, held, settled) for (b, k), (held, settled) in sorted(self.totals.items())]


@dataclass(frozen=True)
class BudgetDecision:
    admitted: bool
    refused_by: Budget | None = None
    num_used_nanos: int = 0
    """What the refusing budget holds this period (settled spend plus reservations)."""
    resets_at: datetime | None = None
    known: bool = False
    """The request was reserved before (a redelivery): admitted, not charged again."""


def held_in(store: SpendStore, budget: Budget, at: datetime) -> tuple[int, int]:
    """(held, settled) against ``budget`` at ``at``, over the buckets that count."""
    held = settled = 0
    for bucket in budget.period.counted(at):
        h, s = store.spent(budget.budget_id, bucket)
        held, settled = held + h, settled + s
    return held, settled


def reserve(
    store: SpendStore,
    budgets: Sequence[Budget],
    tenant_id: str,
    request_id: str,
    num_nanos: int,
    at: datetime,
) -> BudgetDecision:
    """Admits and charges every budget, or refuses if a hard one would be crossed."""
    if store.reservation(tenant_id, request_id) is not None:
        return BudgetDecision(True, known=True)
    refusals = []
    for budget in budgets:
        if budget.hard:
            held, _ = held_in(store, budget, at)
            if num_nanos > budget.num_limit_nanos - held:
                refusals.append((budget.num_limit_nanos - held, held, budget))
    if refusals:
        # The one with the least left binds, and is named.
        _, held, budget = min(refusals, key=lambda r: r[0])
        return BudgetDecision(False, budget, held, budget.period.resets_at(at))
    counters = tuple((b.budget_id, b.period.bucket_of(at)) for b in budgets)
    for budget_id, bucket in counters:
        store.add(tenant_id, budget_id, bucket, num_nanos, 0)
    if counters:
        store.put_reservation(tenant_id, request_id, Reservation(num_nanos, counters))
    return BudgetDecision(True)


def settle(
    store: SpendStore,
    tenant_id: str,
    request_id: str,
    num_nanos_actual: int,
    keep_until: float,
    attempt: int = 0,
) -> tuple[tuple[str, str], ...]:
    """The reservation becomes the billed cost; returns the counters it changed (none
    when there was nothing to settle: no budget applied, or this attempt settled already).

    A request is billed for one run: a second attempt's usage (a worker presumed lost
    that still finished) is superseded by billing, stored but billed nothing
    (``billing.dedup.later_runs``), so here it settles nothing either. (A request whose
    first usage is a refusal never runs again: the job does not dispatch what it refused.)"""
    reservation = store.reservation(tenant_id, request_id)
    if reservation is None or attempt in reservation.attempts:
        return ()
    attempts = (*reservation.attempts, attempt)
    if reservation.settled:
        superseded = Reservation(reservation.num_nanos, reservation.counters, attempts, keep_until)
        store.put_reservation(tenant_id, request_id, superseded)
        return ()
    for budget_id, bucket in reservation.counters:
        store.add(
            tenant_id, budget_id, bucket, num_nanos_actual - reservation.num_nanos, num_nanos_actual
        )
    settled = Reservation(num_nanos_actual, reservation.counters, attempts, keep_until)
    store.put_reservation(tenant_id, request_id, settled)
    return reservation.counters


def release(store: SpendStore, tenant_id: str, request_id: str) -> None:
    """A request that never ran gives its reservation back."""
    reservation = store.reservation(tenant_id, request_id)
    if reservation is None or reservation.settled:
        return
    for budget_id, bucket in reservation.counters:
        store.add(tenant_id, budget_id, bucket, -reservation.num_nanos, 0)
    store.put_reservation(tenant_id, request_id, None)


def due_thresholds(store: SpendStore, budget: Budget, at: datetime) -> list[int]:
    """Thresholds the settled spend has reached and no alert has announced this period
    (rolling: within the buckets that count)."""
    _, settled = held_in(store, budget, at)
    fired: set[int] = set()
    for bucket in budget.period.counted(at):
        fired |= store.fired(budget.budget_id, bucket)
    return [
        t
        for t in budget.thresholds
        if t not in fired and settled * 100 >= t * budget.num_limit_nanos
    ]


# -- what a request costs, by billing's own rule (tokenbus.pricing) --------------------
def max_cost_nanos(pricer: Pricer, item: WorkItem, num_prompt_tokens: int) -> int:
    """The most the request can be billed: its prompt plus ``max_tokens``, at the higher
    of the cached and uncached rates, precision weight 1, share 1 (``cost_units``)."""
    costs = []
    for num_cached in (0, num_prompt_tokens):
        event = usage_of(
            item,
            FinishReason.LENGTH,
            num_prompt_tokens=num_prompt_tokens,
            num_completion_tokens=item.sampling.max_tokens,
            num_cached_tokens=num_cached,
            precision="",
        )
        costs.append(to_nanos(pricer.charge(event).cost_units))
    return max(costs)


def billed_nanos(pricer: Pricer, usage: UsageEvent) -> int:
    """Exactly the ``billed_units`` the billing sink writes for this event."""
    return to_nanos(pricer.charge(usage).billed_units)
