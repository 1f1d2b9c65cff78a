from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import FinishReason, SamplingParams, UsageStatus, WorkItem
from stream_jobs.budgets import (
    Budget,
    BudgetBook,
    MemorySpendStore,
    Period,
    Subject,
    billed_nanos,
    due_thresholds,
    held_in,
    max_cost_nanos,
    release,
    reserve,
    settle,
    to_nanos,
    token_budget,
)
from tokenbus.budget_config import BudgetConfig, parse_budget_id
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer
from tokenbus.usage import usage_of

MARCH = datetime(2026, 3, 15, 12, 0, tzinfo=UTC)


def budget(entity: str, limit: int, period: str = "month", hard: bool = True) -> Budget:
    return Budget(f"{entity}|{period}", entity, limit, Period.parse(period), hard)


def test_calendar_buckets_follow_the_zone() -> None:
    berlin = Period.parse("month", "Europe/Berlin")
    # 23:30 UTC on March 31 is already April 1 in Berlin.
    assert berlin.bucket_of(datetime(2026, 3, 31, 23, 30, tzinfo=UTC)) == "2026-04-01"
    assert Period.parse("month").bucket_of(datetime(2026, 3, 31, 23, 30, tzinfo=UTC)) == (
        "2026-03-01"
    )
    start, end = berlin.bounds("2026-04-01")
    assert start == datetime(2026, 3, 31, 22, 0, tzinfo=UTC)  # CEST, UTC+2
    assert end == datetime(2026, 4, 30, 22, 0, tzinfo=UTC)
    week = Period.parse("week")
    assert week.bucket_of(MARCH) == "2026-03-09"  # the Monday before
    assert week.bounds("2026-03-09")[1] == datetime(2026, 3, 16, tzinfo=UTC)
    day = Period.parse("day", "America/New_York")
    assert day.bounds("2026-03-08") == (  # DST starts that day: 23 hours
        datetime(2026, 3, 8, 5, tzinfo=UTC),
        datetime(2026, 3, 9, 4, tzinfo=UTC),
    )


def test_rolling_counts_at_least_the_last_n_hours() -> None:
    rolling = Period.parse("rolling:3h")
    at = datetime(2026, 3, 15, 12, 40, tzinfo=UTC)
    counted = rolling.counted(at)
    assert len(counted) == 4
    oldest = rolling.bounds(counted[-1])[0]
    assert oldest <= at - timedelta(hours=3) < oldest + timedelta(hours=1)


def test_a_hard_budget_admits_up_to_its_limit_and_never_past_it() -> None:
    store, tenant = MemorySpendStore(), [budget("tenant:a", 1000)]
    assert reserve(store, tenant, "a", "r1", 600, MARCH).admitted
    refused = reserve(store, tenant, "a", "r2", 401, MARCH)
    assert not refused.admitted and refused.refused_by is tenant[0]
    assert refused.num_used_nanos == 600
    assert refused.resets_at == datetime(2026, 4, 1, tzinfo=UTC)
    assert reserve(store, tenant, "a", "r2", 400, MARCH).admitted
    assert held_in(store, tenant[0], MARCH) == (1000, 0)


def test_settle_keeps_the_billed_cost_and_refunds_the_rest() -> None:
    store, tenant = MemorySpendStore(), [budget("tenant:a", 1000)]
    reserve(store, tenant, "a", "r1", 600, MARCH)
    assert settle(store, "a", "r1", 250, keep_until=0) == (("tenant:a|month", "2026-03-01"),)
    assert held_in(store, tenant[0], MARCH) == (250, 250)
    assert settle(store, "a", "r1", 250, keep_until=0) == ()  # a redelivery changes nothing
    assert held_in(store, tenant[0], MARCH) == (250, 250)
    assert reserve(store, tenant, "a", "r1", 600, MARCH).known  # nor does the request
    # Another attempt's run (its worker presumed lost, only slow): billing supersedes it.
    assert settle(store, "a", "r1", 100, keep_until=0, attempt=1) == ()
    assert held_in(store, tenant[0], MARCH) == (250, 250)


def test_settling_after_the_period_counts_in_the_period_of_admission() -> None:
    store, tenant = MemorySpendStore(), [budget("tenant:a", 1000)]
    end_of_march = datetime(2026, 3, 31, 23, 59, 59, tzinfo=UTC)
    reserve(store, tenant, "a", "r1", 900, end_of_march)
    settle(store, "a", "r1", 900, keep_until=0)
    april = datetime(2026, 4, 1, tzinfo=UTC)
    assert held_in(store, tenant[0], april) == (0, 0)
    assert held_in(store, tenant[0], end_of_march) == (900, 900)
    assert reserve(store, tenant, "a", "r2", 1000, april).admitted  # the clock moved on


def test_release_gives_the_reservation_back() -> None:
    store, tenant = MemorySpendStore(), [budget("tenant:a", 1000)]
    reserve(store, tenant, "a", "r1", 1000, MARCH)
    release(store, "a", "r1")
    assert held_in(store, tenant[0], MARCH) == (0, 0)
    assert reserve(store, tenant, "a", "r2", 1000, MARCH).admitted


def test_every_applicable_budget_binds_and_the_smaller_refuses() -> None:
    # A key with a budget of its own under a tenant with one: LiteLLM checks only one.
    key = "ab" * 32
    book = BudgetBook(
        [budget("tenant:team", 1000), budget(f"key:{key}", 300), budget("tenant:other", 5)]
    )
    by_key = book.applicable(Subject("team", "m", key))
    assert {b.entity for b in by_key} == {"tenant:team", f"key:{key}"}
    store = MemorySpendStore()
    assert reserve(store, by_key, "team", "k1", 300, MARCH).admitted
    refused = reserve(store, by_key, "team", "k2", 1, MARCH)
    assert refused.refused_by is not None and refused.refused_by.entity == f"key:{key}"
    # Other credentials of the tenant still spend the tenant's remainder, and then stop.
    by_tenant = book.applicable(Subject("team", "m", None))
    assert reserve(store, by_tenant, "team", "t1", 700, MARCH).admitted
    refused = reserve(store, by_tenant, "team", "t2", 1, MARCH)
    assert refused.refused_by is not None and refused.refused_by.entity == "tenant:team"


def test_a_token_s_balance_and_its_tenant_s_remainder_the_smaller_binds() -> None:
    token = "cd" * 32
    tenant = budget("tenant:team", 1000)
    balance = token_budget(token, Decimal("0.000000400"))  # 400 nano-units for its life
    assert (balance.budget_id, balance.num_limit_nanos) == (f"key:{token}|total", 400)
    store = MemorySpendStore()
    # The token's balance is the smaller remainder: it refuses, the tenant has room.
    assert reserve(store, [tenant, balance], "team", "t1", 300, MARCH).admitted
    refused = reserve(store, [tenant, balance], "team", "t2", 200, MARCH)
    assert refused.refused_by == balance and refused.resets_at is None  # never turns
    # Other credentials spend the tenant down until its remainder is the smaller one.
    assert reserve(store, [tenant], "team", "o1", 650, MARCH).admitted
    refused = reserve(store, [tenant, balance], "team", "t3", 60, MARCH)
    assert refused.refused_by == tenant  # 50 left of the tenant's, 100 of the token's
    assert reserve(store, [tenant, balance], "team", "t4", 50, MARCH).admitted
    # The balance spans periods: next month the tenant has room, the token has 50.
    april = MARCH + timedelta(days=31)
    refused = reserve(store, [tenant, balance], "team", "t5", 60, april)
    assert refused.refused_by == balance
    assert held_in(store, balance, april) == (350, 0)


def test_a_model_budget_spans_tenants() -> None:
    model = [budget("model:m", 1000)]
    store = MemorySpendStore()
    assert reserve(store, model, "a", "r", 600, MARCH).admitted
    assert not reserve(store, model, "b", "r", 600, MARCH).admitted


def test_a_soft_budget_admits_past_its_limit_and_alerts_once_per_threshold() -> None:
    soft = budget("tenant:a", 1000, hard=False)
    store = MemorySpendStore()
    for i, cost in enumerate((400, 400, 300)):
        assert reserve(store, [soft], "a", f"r{i}", cost, MARCH).admitted
        settle(store, "a", f"r{i}", cost, keep_until=0)
        due = due_thresholds(store, soft, MARCH)
        for threshold in due:
            store.fire("a", soft.budget_id, "2026-03-01", threshold)
        assert due == [[], [50, 80], [95, 100]][i]
    assert due_thresholds(store, soft, MARCH) == []
    assert due_thresholds(store, soft, datetime(2026, 4, 2, tzinfo=UTC)) == []  # nothing spent


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 400),  # reserved
            st.integers(0, 400),  # billed, at most the reservation
            st.sampled_from(["settle", "release", "open"]),
        ),
        max_size=40,
    )
)
def test_admitted_spend_never_passes_a_hard_limit(
    steps: list[tuple[int, int, str]],
) -> None:
    limit = 1500
    tenant = [budget("tenant:a", limit)]
    store = MemorySpendStore()
    billed = 0
    for i, (reserved, actual, end) in enumerate(steps):
        if not reserve(store, tenant, "a", f"r{i}", reserved, MARCH).admitted:
            continue
        if end == "settle":
            actual = min(actual, reserved)
            settle(store, "a", f"r{i}", actual, keep_until=0)
            billed += actual
        elif end == "release":
            release(store, "a", f"r{i}")
        held, settled = held_in(store, tenant[0], MARCH)
        assert settled == billed <= held <= limit


def test_the_reservation_covers_the_bill_and_the_bill_is_billings() -> None:
    pricer = Pricer(read_price_book(BUNDLED_PRICES))
    item = WorkItem(
        request_id="r",
        session_id="s",
        tenant_id="a",
        model="tiny-llama",
        prompt="hi",
        sampling=SamplingParams(max_tokens=100),
        reply_to="tokenbus.replies.a.c",
        created_at=MARCH,
        admitted_at=MARCH,
        cache_salt="a",
    )
    ceiling = max_cost_nanos(pricer, item, 3000)
    for num_completion in (0, 50, 100):
        for num_cached in (0, 1000, 3000):
            for status in (UsageStatus.OK, UsageStatus.CANCELLED):
                usage = usage_of(
                    item,
                    FinishReason.LENGTH,
                    status=status,
                    num_prompt_tokens=3000,
                    num_completion_tokens=num_completion,
                    num_cached_tokens=num_cached,
                    precision="int8",
                )
                charged = billed_nanos(pricer, usage)
                assert charged <= ceiling
                assert Decimal(charged).scaleb(-9) == pricer.charge(usage).billed_units


def test_budget_ids_name_entity_period_and_zone() -> None:
    config = BudgetConfig(tenant="acme", model="m", limit=Decimal("500"), period="month")
    assert config.budget_id("Europe/Berlin") == "tenant_model:acme/m|month@Europe/Berlin"
    assert parse_budget_id("tenant_model:acme/m|month@Europe/Berlin") == (
        "tenant_model:acme/m",
        "month",
        "Europe/Berlin",
    )
    rolling = BudgetConfig(key_sha256="ab" * 32, limit=Decimal(1), period="rolling:24h")
    assert rolling.budget_id("UTC") == f"key:{'ab' * 32}|rolling:24h"
    assert Budget.from_config(config).num_limit_nanos == to_nanos(Decimal(500))
    with pytest.raises(ValueError):
        BudgetConfig(tenant="a", limit=Decimal(1), thresholds=(0, 50))


def test_budgets_are_read_from_the_tenants_file(tmp_path: Path) -> None:
    from tokenbus.tenants import TenantConfig, TenantConfigError, TenantDirectory

    path = tmp_path / "tenants.toml"
    path.write_text(
        '[tenants.acme]\n[[tenants.acme.budgets]]\nlimit = "500"\nmodel = "m"\n'
        'tz = "Europe/Berlin"\nthresholds = [80, 50]\n'
        '[[budgets]]\nmodel = "m"\nlimit = 1000\nperiod = "rolling:24h"\nenforce = "soft"\n'
    )
    configs = TenantDirectory.from_file(path, TenantConfig(tenant_id="*")).budget_configs()
    assert [c.budget_id("UTC") for c in configs] == [
        "model:m|rolling:24h",
        "tenant_model:acme/m|month@Europe/Berlin",
    ]
    assert configs[1].thresholds == (50, 80)
    path.write_text('[[budgets]]\nlimit = 1\nperiod = "fortnight"\nmodel = "m"\n')
    with pytest.raises(TenantConfigError, match="budgets"):
        TenantDirectory.from_file(path, TenantConfig(tenant_id="*"))
