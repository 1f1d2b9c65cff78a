from __future__ import annotations

import pytest

from stream_jobs.tiers import Tier, TierAction, TierPolicy, apply_tier, demand_ratio

POLICY = TierPolicy()


@pytest.mark.parametrize(
    ("current", "demand", "expected"),
    [
        (Tier.NORMAL, 1.0, Tier.NORMAL),
        (Tier.NORMAL, 1.21, Tier.CAP),
        (Tier.NORMAL, 1.51, Tier.SHED),
        (Tier.CAP, 1.18, Tier.CAP),  # inside the release margin: holds
        (Tier.CAP, 1.14, Tier.NORMAL),
        (Tier.SHED, 1.47, Tier.SHED),
        (Tier.SHED, 1.44, Tier.CAP),
        (Tier.SHED, 1.0, Tier.NORMAL),
    ],
)
def test_tiers_engage_above_and_release_below_a_margin(
    current: Tier, demand: float, expected: Tier
) -> None:
    assert POLICY.next_tier(current, demand) is expected


def test_class_zero_is_never_touched() -> None:
    assert apply_tier(POLICY, Tier.SHED, 0, 4096).shed is False
    assert apply_tier(POLICY, Tier.SHED, 0, 4096).max_tokens is None


def test_cap_tier_caps_classes_one_and_two() -> None:
    assert apply_tier(POLICY, Tier.CAP, 1, 1000).max_tokens == 256
    assert apply_tier(POLICY, Tier.CAP, 2, 1000).max_tokens == 256
    assert apply_tier(POLICY, Tier.CAP, 2, 100).max_tokens is None  # already below the cap


def test_shed_tier_sheds_class_two_and_caps_class_one() -> None:
    assert apply_tier(POLICY, Tier.SHED, 2, 10).shed
    assert apply_tier(POLICY, Tier.SHED, 1, 1000).max_tokens == 256


def test_demand_counts_running_and_waiting_over_capacity() -> None:
    assert demand_ratio(64, 32, 64) == 1.5
    assert demand_ratio(0, 0, 64) == 0.0


@pytest.mark.parametrize("num_waiting", [0, 1, 96, 10_000])
def test_without_capacity_demand_is_unknown_not_overload(num_waiting: int) -> None:
    demand = demand_ratio(0, num_waiting, 0)
    assert demand is None
    assert POLICY.next_tier(Tier.NORMAL, demand) is Tier.NORMAL


@pytest.mark.parametrize("current", list(Tier))
def test_capacity_lost_releases_every_tier(current: Tier) -> None:
    # Every worker lost: nothing is shed or capped on a guess until capacity is known.
    tier = POLICY.next_tier(current, demand_ratio(5, 50, 0))
    assert tier is Tier.NORMAL
    assert apply_tier(POLICY, tier, 2, 4096) == TierAction()
