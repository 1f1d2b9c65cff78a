"""Cost = list price x the shared weight, at each context length; billed share by status."""

import random
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import pytest

from schemas import UsageEvent, UsageStatus
from tokenbus.cost import PeakHours, cost_weight
from tokenbus.pricing import (
    COST_QUANTUM,
    UNPRICED_VERSION,
    ChargePolicy,
    Price,
    PriceBook,
    Pricer,
    list_cost,
)

T0 = datetime(2026, 3, 2, 3, 0, tzinfo=UTC)  # 03:00 UTC: outside 9-17 peak hours
V1 = Price(
    model="m",
    version=1,
    effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    input_per_1k=Decimal("0.001"),
    output_per_1k=Decimal("0.002"),
    cached_input_per_1k=Decimal("0.0005"),
)
V2 = Price(
    model="m",
    version=2,
    effective_from=datetime(2026, 3, 1, tzinfo=UTC),
    input_per_1k=Decimal("0.003"),
    output_per_1k=Decimal("0.004"),
    cached_input_per_1k=Decimal("0.001"),
)
ANY = Price(
    model="*",
    version=1,
    effective_from=datetime(2025, 1, 1, tzinfo=UTC),
    input_per_1k=Decimal("0.01"),
    output_per_1k=Decimal("0.01"),
    cached_input_per_1k=Decimal("0.01"),
)


def _event(num_prompt: int, num_completion: int = 0, **overrides: object) -> UsageEvent:
    fields: dict[str, object] = {
        "request_id": "req_1",
        "session_id": "sess_1",
        "tenant_id": "acme",
        "model": "m",
        "status": UsageStatus.OK,
        "num_prompt_tokens": num_prompt,
        "num_completion_tokens": num_completion,
        "created_at": T0,
    }
    fields.update(overrides)
    return UsageEvent.model_validate(fields)


@pytest.mark.parametrize(
    ("num_prompt", "weight"),
    [
        (1000, Decimal("1.0")),
        (2047, Decimal("1.0")),
        (2048, Decimal("1.2")),
        (4096, Decimal("1.3")),
        (6144, Decimal("1.4")),
        (8192, Decimal("1.5")),
        (12_288, Decimal("1.7")),
        (16_000, Decimal("1.8")),
    ],
)
def test_cost_follows_the_weight_rule_at_each_context_length(
    num_prompt: int, weight: Decimal
) -> None:
    pricer = Pricer(PriceBook([V2]))
    event = _event(num_prompt, num_completion=100)

    charge = pricer.charge(event)

    # Written out by hand: prompt at the input price, completion at the output price.
    at_list_price = (num_prompt * Decimal("0.003") + 100 * Decimal("0.004")) / 1000
    assert charge.cost_weight == float(weight)
    assert charge.cost_units == (at_list_price * weight).quantize(COST_QUANTUM)
    assert charge.billed_units == charge.cost_units
    assert charge.price_version == 2


def test_the_weight_is_the_shared_quota_weight_with_precision_and_peak_hour() -> None:
    peak = PeakHours.parse("9-17")
    at_peak = T0.replace(hour=10)
    event = _event(9000, num_completion=50, precision="int8", created_at=at_peak)

    charge = Pricer(PriceBook([V2]), peak).charge(event)

    weight = cost_weight(9000, "int8", at_peak, peak)
    assert weight == 1.575  # context 1.5 (8k) x int8 0.7 x peak 1.5
    assert charge.cost_weight == weight
    expected = list_cost(event, V2) * Decimal("1.575")
    assert charge.cost_units == expected.quantize(COST_QUANTUM)


def test_cached_prompt_tokens_are_priced_at_the_cached_rate() -> None:
    event = _event(1000, num_completion=10, num_cached_tokens=600)

    assert (
        list_cost(event, V2)
        == (400 * Decimal("0.003") + 600 * Decimal("0.001") + 10 * Decimal("0.004")) / 1000
    )


def test_a_cached_count_above_the_prompt_is_capped_at_the_prompt() -> None:
    event = _event(100, num_cached_tokens=500)

    assert list_cost(event, V2) == 100 * Decimal("0.001") / 1000


def test_the_version_in_force_when_the_request_was_created_applies() -> None:
    pricer = Pricer(PriceBook([V2, V1, ANY]))

    assert pricer.charge(_event(10, created_at=datetime(2026, 2, 1, tzinfo=UTC))).price_version == 1
    assert pricer.charge(_event(10, created_at=V2.effective_from)).price_version == 2
    other = pricer.charge(_event(1000, model="other"))
    assert (other.price_version, other.cost_units) == (1, Decimal("0.01"))
    before_all = pricer.charge(_event(1000, created_at=datetime(2024, 1, 1, tzinfo=UTC)))
    assert before_all == before_all.__class__(1.0, Decimal(0), Decimal(0), UNPRICED_VERSION)


@pytest.mark.parametrize(
    ("status", "billed_share"),
    [
        (UsageStatus.OK, 1),
        (UsageStatus.CANCELLED, 1),
        (UsageStatus.FAILED, 0),
    ],
)
def test_failed_and_cancelled_work_is_priced_and_billed_by_policy(
    status: UsageStatus, billed_share: int
) -> None:
    charge = Pricer(PriceBook([V2])).charge(_event(500, num_completion=20, status=status))

    assert charge.cost_units == Decimal("0.00158")  # the work's cost, whatever its end
    assert charge.billed_units == charge.cost_units * billed_share


def test_rejected_work_never_ran_so_it_costs_nothing() -> None:
    # The dispatcher may report the prompt it counted before refusing it.
    charge = Pricer(PriceBook([V2])).charge(_event(500, status=UsageStatus.REJECTED))

    assert (charge.cost_units, charge.billed_units, charge.price_version) == (
        Decimal(0),
        Decimal(0),
        2,
    )


def test_a_policy_can_bill_part_of_failed_work() -> None:
    policy = ChargePolicy({UsageStatus.FAILED: Decimal("0.5")})
    charge = Pricer(PriceBook([V2], policy)).charge(
        _event(333, num_completion=7, status=UsageStatus.FAILED)
    )

    assert charge.billed_units == (charge.cost_units / 2).quantize(COST_QUANTUM)


def test_money_is_quantized_to_nine_decimals() -> None:
    tiny = Price("m", 1, T0 - timedelta(days=1), Decimal("0.0000001"), Decimal(0), Decimal(0))
    charge = Pricer(PriceBook([tiny])).charge(_event(2048))

    assert charge.cost_units == Decimal("0.000000246")  # 2048 x 1e-10 x 1.2, rounded
    assert charge.cost_units.as_tuple().exponent == -9


@pytest.mark.parametrize(
    ("prices", "message"),
    [
        ([V1, V1], "twice"),
        ([V1, Price(**{**V2.__dict__, "effective_from": V1.effective_from})], "later"),
        ([Price(**{**V1.__dict__, "version": 0})], "start at 1"),
    ],
)
def test_inconsistent_versions_are_refused(prices: list[Price], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PriceBook(prices)


def test_the_integer_computation_equals_the_decimal_definition() -> None:
    rng = random.Random(3)
    peak = PeakHours.parse("9-17")
    policy = ChargePolicy({UsageStatus.FAILED: Decimal("0.333333")})
    prices = [
        Price(
            model="m",
            version=1,
            effective_from=datetime(2026, 1, 1, tzinfo=UTC),
            input_per_1k=Decimal(rng.randint(0, 10**7)).scaleb(-9),
            output_per_1k=Decimal(rng.randint(0, 10**7)).scaleb(-9),
            cached_input_per_1k=Decimal(rng.randint(0, 10**6)).scaleb(-9),
        )
    ]
    pricer = Pricer(PriceBook(prices, policy), peak)
    for _ in range(2000):
        event = _event(
            rng.randint(0, 20_000),
            rng.randint(0, 4_000),
            num_cached_tokens=rng.randint(0, 3_000),
            precision=rng.choice(["int8", "fp16"]),
            status=rng.choice([UsageStatus.OK, UsageStatus.FAILED]),
            created_at=T0 + timedelta(minutes=rng.randint(0, 24 * 60)),
        )
        weight = Decimal(
            str(cost_weight(event.num_prompt_tokens, event.precision, event.created_at, peak))
        )
        cost = (list_cost(event, prices[0]) * weight).quantize(COST_QUANTUM, ROUND_HALF_EVEN)
        billed = (cost * policy.share(event.status)).quantize(COST_QUANTUM, ROUND_HALF_EVEN)

        charge = pricer.charge(event)

        assert (charge.cost_units, charge.billed_units) == (cost, billed), event


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Price(**{**V1.__dict__, "input_per_1k": Decimal("0.0000000001")}), "9 decimals"),
        (lambda: ChargePolicy({UsageStatus.FAILED: Decimal("0.1234567")}), "6 decimals"),
    ],
)
def test_amounts_finer_than_the_columns_are_refused(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


ADAPTER = Price(
    model="m:acme-support",
    version=1,
    effective_from=datetime(2026, 1, 1, tzinfo=UTC),
    input_per_1k=Decimal("0.002"),
    output_per_1k=Decimal("0.006"),
    cached_input_per_1k=Decimal("0.001"),
)


def test_an_adapter_has_its_own_price_else_its_base_models() -> None:
    book = PriceBook([V1, ADAPTER, ANY])
    pricer = Pricer(book)

    assert book.price_for("m", T0, "acme-support") is ADAPTER
    assert book.price_for("m", T0, "other-adapter") is V1
    assert book.price_for("m", T0) is V1
    own = pricer.charge(_event(1000, 1000, adapter="acme-support"))
    base = pricer.charge(_event(1000, 1000, adapter="other-adapter"))
    assert own.cost_units == Decimal("0.008") and base.cost_units == Decimal("0.003")


def test_the_remembered_weights_are_the_shared_weights() -> None:
    peak = PeakHours.parse("9-17", "Asia/Kathmandu")  # a zone 5:45 off UTC
    pricer = Pricer(PriceBook([V1, V2]), peak)
    rng = random.Random(3)
    for _ in range(2_000):
        at = T0 + timedelta(minutes=rng.randint(0, 3 * 24 * 60), seconds=rng.random())
        event = _event(
            rng.choice([0, 1, 2047, 2048, 4095, 4096, 9000, 20_000, -5]),
            precision=rng.choice(["fp16", "int8", " INT8 ", "bf16"]),
            created_at=at,
        )
        expected = cost_weight(event.num_prompt_tokens, event.precision, at, peak)
        assert pricer.charge(event).cost_weight == expected


def test_a_batch_line_costs_the_batch_share_of_the_list_price() -> None:
    pricer = Pricer(PriceBook([V1]))  # the default multiplier: half, as OpenAI's batch
    interactive = _event(1000, 500, num_cached_tokens=200)
    line = _event(1000, 500, num_cached_tokens=200, batch_id="batch_01", priority=2)

    full, batch = pricer.charge(interactive), pricer.charge(line)

    assert full.cost_units == Decimal("0.0019")  # 800 x 0.001 + 200 x 0.0005 + 500 x 0.002
    assert batch.cost_units == batch.billed_units == Decimal("0.00095")
    assert batch.price_version == full.price_version == 1


def test_the_batch_multiplier_applies_to_the_weighted_cost_and_the_billed_share() -> None:
    policy = ChargePolicy({UsageStatus.CANCELLED: Decimal("0.5")})
    pricer = Pricer(PriceBook([V1], policy, batch_multiplier=Decimal("0.3")))
    line = _event(
        8192, 100, batch_id="b", precision="int8", status=UsageStatus.CANCELLED, priority=2
    )

    charge = pricer.charge(line)

    weight = Decimal(str(cost_weight(8192, "int8", T0, PeakHours.parse(""))))
    cost = (list_cost(line, V1) * weight * Decimal("0.3")).quantize(COST_QUANTUM)
    assert charge.cost_units == cost
    assert charge.billed_units == (cost / 2).quantize(COST_QUANTUM, ROUND_HALF_EVEN)


def test_batch_lines_by_integers_equal_the_decimal_definition() -> None:
    rng = random.Random(5)
    multiplier = Decimal("0.437251")
    price = Price(
        model="m",
        version=1,
        effective_from=datetime(2026, 1, 1, tzinfo=UTC),
        input_per_1k=Decimal(rng.randint(0, 10**7)).scaleb(-9),
        output_per_1k=Decimal(rng.randint(0, 10**7)).scaleb(-9),
        cached_input_per_1k=Decimal(rng.randint(0, 10**6)).scaleb(-9),
    )
    pricer = Pricer(PriceBook([price], batch_multiplier=multiplier))
    for _ in range(2000):
        line = _event(
            rng.randint(0, 20_000),
            rng.randint(0, 4_000),
            num_cached_tokens=rng.randint(0, 3_000),
            precision=rng.choice(["int8", "fp16"]),
            batch_id="b",
            priority=2,
        )
        weight = Decimal(str(cost_weight(line.num_prompt_tokens, line.precision, T0)))
        cost = (list_cost(line, price) * weight * multiplier).quantize(
            COST_QUANTUM, ROUND_HALF_EVEN
        )

        assert pricer.charge(line).cost_units == cost, line


def test_a_batch_multiplier_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        PriceBook([V1], batch_multiplier=Decimal("1.01"))
    with pytest.raises(ValueError, match="6 decimals"):
        PriceBook([V1], batch_multiplier=Decimal("0.1234567"))


def test_pricing_a_mixed_batch_in_one_call_gives_each_event_its_own_charge() -> None:
    # One loop prices the sink's whole batch: no branch taken for one event (unpriced,
    # rejected, a batch line, a billed share, peak hours, an adapter) may leak into the
    # next one's charge.
    rng = random.Random(11)
    policy = ChargePolicy({UsageStatus.FAILED: Decimal("0.333333")})
    book = PriceBook([V1, V2, ADAPTER], policy, batch_multiplier=Decimal("0.4"))
    pricer = Pricer(book, PeakHours.parse("9-17"))
    events = [
        _event(
            rng.choice([0, 500, 2048, 9000, -3]),
            rng.randint(0, 800),
            num_cached_tokens=rng.choice([0, 100, 5000, -1]),
            model=rng.choice(["m", "m", "unpriced"]),
            adapter=rng.choice([None, "acme-support", "other"]),
            status=rng.choice(list(UsageStatus)),
            precision=rng.choice(["fp16", "int8"]),
            batch_id=rng.choice([None, "b"]),
            created_at=T0 + timedelta(hours=rng.randint(-24 * 70, 24)),
        )
        for _ in range(3_000)
    ]

    charges = pricer.charge_nanos_each(events)

    alone = [Pricer(book, PeakHours.parse("9-17")).charge_nanos(event) for event in events]
    assert charges == alone
    versions = {version for _, _, _, version in charges}
    assert versions == {UNPRICED_VERSION, 1, 2}  # every branch of the price lookup taken
    for event, (_, cost, billed, _) in zip(events, charges, strict=True):
        if event.status is UsageStatus.REJECTED or event.model == "unpriced":
            assert cost == billed == 0
        expected = pricer.charge(event)
        assert (Decimal(cost).scaleb(-9), Decimal(billed).scaleb(-9)) == (
            expected.cost_units,
            expected.billed_units,
        )
