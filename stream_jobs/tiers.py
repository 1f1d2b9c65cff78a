"""Overload tiers: what the job does to new work as demand outgrows the fleet.

Demand is the requests running, queued in the workers and waiting in the job, over the
fleet's capacity (the sum of the live workers' ``max_num_seqs``), leaving out a batch
job's lines: they fill idle seats and yield to classes 0 and 1, so a running batch
never caps or sheds anything (``Dispatcher._update_tier``).

- tier 0, demand <= 120%: nothing changes;
- tier 1, above 120%: ``max_tokens`` is capped at 256 for classes 1 and 2;
- tier 2, above 150%: class 2 is shed (rejected with ``retry_after``), class 1 capped.

A tier is released only once demand is a margin below its threshold, so a load that
hovers at a boundary does not flap. Pure: the caller recomputes on every change.

Unknown capacity is not overload: before the first heartbeat, or with every worker
lost, demand is unknown (``None``) and the tier is normal. Requests then wait for a
worker or get ``no_worker``; none is shed or capped on a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from tokenbus.config import Settings


class Tier(IntEnum):
    NORMAL = 0
    CAP = 1
    SHED = 2


_SET = Settings.model_fields
"""The defaults are the settings' (``tier_*``): one set of numbers."""


@dataclass(frozen=True)
class TierPolicy:
    cap_above: float = _SET["tier_cap_above"].default
    shed_above: float = _SET["tier_shed_above"].default
    release_margin: float = 0.05
    capped_max_tokens: int = _SET["tier_capped_max_tokens"].default

    def next_tier(self, current: Tier, demand: float | None) -> Tier:
        if demand is None:
            return Tier.NORMAL
        margin = self.release_margin
        if demand > self.shed_above or (current is Tier.SHED and demand > self.shed_above - margin):
            return Tier.SHED
        if demand > self.cap_above or (current >= Tier.CAP and demand > self.cap_above - margin):
            return Tier.CAP
        return Tier.NORMAL


@dataclass(frozen=True)
class TierAction:
    shed: bool = False
    max_tokens: int | None = None
    """The capped max_tokens, when the tier lowers it."""


def apply_tier(policy: TierPolicy, tier: Tier, priority: int, max_tokens: int) -> TierAction:
    if priority == 0 or tier is Tier.NORMAL:
        return TierAction()
    if tier is Tier.SHED and priority == 2:
        return TierAction(shed=True)
    if max_tokens > policy.capped_max_tokens:
        return TierAction(max_tokens=policy.capped_max_tokens)
    return TierAction()


def demand_ratio(num_busy: int, num_waiting: int, capacity: int) -> float | None:
    """Demand over capacity; ``None`` when no live worker says what the capacity is."""
    if capacity <= 0:
        return None
    return (num_busy + num_waiting) / capacity
