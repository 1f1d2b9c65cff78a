"""The sink's faster writing steps store exactly what the previous steps stored.

Each test puts the new step beside the one it replaced, kept here as the reference:
the bytes clickhouse-connect sends for the cost columns, the dedup token, the status
texts of a row, and the Decimal costs and DateTime64 ticks of a whole column block.
"""

from __future__ import annotations

import decimal
import hashlib
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from clickhouse_connect.datatypes.numeric import BigDecimal
from clickhouse_connect.datatypes.registry import get_from_name

from billing.dedup import UsageKey, dedup_token
from billing.rows import USAGE_COLUMNS
from billing.storage import ScaledDecimal, ScaledIntegers, _scaled_decimal
from billing.usage_codec import decode_usage
from schemas import FinishReason, UsageEvent, UsageStatus, encode
from tests.unit.usage_rows import ticks, usage_row
from tokenbus.pricing import ChargePolicy, Price, PriceBook, Pricer, list_cost, quantize


def _written(column_type: Any, values: list[Any]) -> bytes:
    dest = bytearray()
    column_type._write_column_binary(values, dest, None)
    return bytes(dest)


_VALUES = [
    Decimal(0),
    Decimal("0.000000001"),
    Decimal("-0.000000001"),
    Decimal("1.5"),
    Decimal("123456.789012345"),
    Decimal("-98765.000000001"),
    Decimal("9223372036.854775807"),  # the largest int64 of nano-units
    Decimal("9223372036.854775808"),  # one past it: written the slow way
    Decimal("-9223372036.854775809"),
    Decimal("99999999999999999999999999999.999999999"),  # Decimal(38, 9) at its widest
    Decimal("1.0000000005"),  # more decimals than the column: cut towards zero
    Decimal("-1.0000000005"),
    Decimal("1E+3"),
    1,
    2.25,
    "3.000000007",
]


@pytest.mark.parametrize("type_name", ["Decimal(38, 9)", "Decimal128(9)", "Decimal(76, 9)"])
def test_scaled_decimal_writes_the_bytes_clickhouse_connect_writes(type_name: str) -> None:
    reference = get_from_name(type_name)
    assert isinstance(reference, BigDecimal)
    scaled = _scaled_decimal(reference)
    assert isinstance(scaled, ScaledDecimal)
    assert scaled.name == reference.name
    for values in (_VALUES, _VALUES[:7], [Decimal(n).scaleb(-9) for n in range(-500, 500, 7)]):
        assert _written(scaled, values) == _written(reference, values)


def test_scaled_decimal_writes_nulls_as_clickhouse_connect_does() -> None:
    reference = get_from_name("Nullable(Decimal(38, 9))")
    scaled = _scaled_decimal(reference)
    assert isinstance(scaled, ScaledDecimal)
    values = [None, Decimal("1.25"), None, Decimal(0), Decimal("-7.000000003")]
    assert _written(scaled, values) == _written(reference, values)


def test_other_types_are_kept() -> None:
    for name in ("Decimal(18, 9)", "String", "DateTime64(3, 'UTC')", "UInt32"):
        column_type = get_from_name(name)
        assert _scaled_decimal(column_type) is column_type


def _previous_dedup_token(keys: Iterable[UsageKey]) -> str:
    digest = hashlib.sha256()
    for key in sorted(keys):
        digest.update("\x1f".join(map(str, key)).encode())
        digest.update(b"\x1e")
    return f"usage-{digest.hexdigest()}"


def test_dedup_token_is_the_previous_digest_where_texts_sort_as_keys() -> None:
    # Single-digit attempts and ids without control characters: the texts sort as the
    # tuples did, so the token is the one the previous code made.
    keys: list[UsageKey] = [(f"t{i % 3}", f"sess-{i // 2}", f"req-é{i}", i % 4) for i in range(200)]
    assert dedup_token(keys) == _previous_dedup_token(keys)
    assert dedup_token(reversed(keys)) == dedup_token(keys)
    assert dedup_token([]) == _previous_dedup_token([])


def test_dedup_token_is_one_per_set_of_keys() -> None:
    # Attempts 9 and 10 sort one way as numbers, the other way as text: still one token
    # per set, whatever the order, and another for another set.
    keys: list[UsageKey] = [("t", "s", "r", 9), ("t", "s", "r", 10), ("t", "s1", "r", 0)]
    tokens = {dedup_token(keys), dedup_token(keys[::-1]), dedup_token(keys[1:] + keys[:1])}
    assert len(tokens) == 1
    assert dedup_token(keys[:2]) not in tokens
    assert dedup_token([("t", "s", "r", 91), ("t", "s", "r", 0)]) != dedup_token(
        [("t", "s", "r", 9), ("t", "s", "r", 10)]
    )


_BASE = datetime(2026, 1, 1, tzinfo=UTC)
_BOOK = PriceBook(
    [
        Price(
            "tiny-llama",
            1,
            _BASE - timedelta(days=1),
            Decimal("0.0105"),
            Decimal("0.021"),
            Decimal("0.000007"),
        )
    ],
    ChargePolicy(
        {
            UsageStatus.OK: Decimal(1),
            UsageStatus.CANCELLED: Decimal("0.333333"),
            UsageStatus.FAILED: Decimal(0),
            UsageStatus.REJECTED: Decimal(0),
        }
    ),
)


def _events() -> list[UsageEvent]:
    statuses = list(UsageStatus)
    reasons = [*FinishReason, None]
    return [
        UsageEvent(
            request_id=f"req-{i}",
            session_id=f"sess-{i // 3}",
            tenant_id=f"t{i % 4}",
            model="tiny-llama" if i % 5 else "unpriced",
            status=statuses[i % len(statuses)],
            finish_reason=reasons[i % len(reasons)],
            num_prompt_tokens=(i * 37) % 5000,
            num_completion_tokens=(i * 11) % 700,
            num_cached_tokens=(i * 13) % 300,
            precision=("fp16", "fp32", "int8")[i % 3],
            created_at=_BASE + timedelta(microseconds=i * 1_234_567),
            finished_at=_BASE + timedelta(microseconds=i * 1_234_567 + 999),
        )
        for i in range(300)
    ]


def test_charges_equal_the_decimal_definition() -> None:
    pricer = Pricer(_BOOK)
    for event in _events():
        charge = pricer.charge(event)
        price = _BOOK.price_for(event.model, event.created_at)
        if price is None or event.status is UsageStatus.REJECTED:
            assert charge.cost_units == charge.billed_units == 0
            continue
        cost = quantize(list_cost(event, price) * Decimal(repr(charge.cost_weight)))
        assert charge.cost_units == cost
        assert charge.billed_units == quantize(cost * _BOOK.policy.share(event.status))
        assert charge.cost_units.as_tuple().exponent == -9


def test_rows_hold_the_enum_texts_and_the_column_block_is_unchanged() -> None:
    pricer = Pricer(_BOOK)
    events = _events()
    fast = [decode_usage(encode(event)) for event in events]  # msgspec, as the sink reads
    rows = [usage_row(event, pricer.charge(event)) for event in fast]
    status = USAGE_COLUMNS.index("status")
    reason = USAGE_COLUMNS.index("finish_reason")
    for event, row in zip(events, rows, strict=True):
        assert row[status] == event.status.value
        assert type(row[status]) is str
        assert row[reason] == (event.finish_reason.value if event.finish_reason else "")
    # The cost columns: the same bytes as clickhouse-connect's own Decimal(38, 9) writer.
    reference = get_from_name("Decimal(38, 9)")
    scaled = _scaled_decimal(reference)
    for name in ("cost_units", "billed_units"):
        column = [row[USAGE_COLUMNS.index(name)] for row in rows]
        assert _written(scaled, column) == _written(reference, column)
        with decimal.localcontext() as ctx:
            ctx.prec = 38
            nanos = [int(value.scaleb(9)) for value in column]
        assert [Decimal(n).scaleb(-9) for n in nanos] == column
    # The DateTime64(3) ticks: what clickhouse-connect computes from the datetimes.
    for name in ("created_at", "finished_at"):
        values = [row[USAGE_COLUMNS.index(name)] for row in rows]
        written = [ticks(value) for value in values]
        assert written == [int(value.timestamp() * 1000) for value in values]
        assert all(value.tzinfo is UTC for value in values)


def test_charges_in_nano_units_are_the_charges_scaled() -> None:
    pricer = Pricer(_BOOK)
    for event in [*_events(), *(decode_usage(encode(e)) for e in _events())]:
        charge = pricer.charge(event)
        weight, cost, billed, version = pricer.charge_nanos(event)
        assert (weight, version) == (charge.cost_weight, charge.price_version)
        assert (type(cost), type(billed)) == (int, int)
        assert Decimal(cost).scaleb(-9) == charge.cost_units
        assert Decimal(billed).scaleb(-9) == charge.billed_units


@pytest.mark.parametrize(
    "type_name", ["Decimal(38, 9)", "Decimal(76, 9)", "Nullable(Decimal(38, 9))"]
)
def test_scaled_integers_write_the_bytes_of_their_decimals(type_name: str) -> None:
    reference = get_from_name(type_name)
    scaled = _scaled_decimal(reference)
    integers = _scaled_decimal(reference, ScaledIntegers)
    assert isinstance(scaled, ScaledDecimal) and isinstance(integers, ScaledIntegers)
    columns: list[list[Any]] = [
        _VALUES,
        _VALUES[:7],
        [Decimal(n).scaleb(-9) for n in range(0, 5000, 7)],  # none negative
        [Decimal(n).scaleb(-9) for n in range(-500, 500, 7)],
    ]
    if reference.nullable:
        columns.append([None, Decimal("1.25"), None, Decimal(0), Decimal("-7.000000003")])
    for values in columns:
        ints: list[Any] = scaled.scaled(values)
        if reference.nullable:
            ints = [None if value is None else n for value, n in zip(values, ints, strict=True)]
        assert _written(integers, ints) == _written(reference, values)
