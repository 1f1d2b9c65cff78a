from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from billing.rows import USAGE_COLUMNS, UnstorableEvent, millis, usage_columns
from schemas import FinishReason, UsageEvent, UsageStatus
from tests.unit.usage_rows import ticks, usage_row
from tokenbus.pricing import Charge, NanoCharge

CHARGE = Charge(
    cost_weight=1.2, cost_units=Decimal("0.5"), billed_units=Decimal("0.25"), price_version=3
)


def _event(**overrides: object) -> UsageEvent:
    fields: dict[str, object] = {
        "request_id": "req_1",
        "session_id": "sess_1",
        "tenant_id": "acme",
        "model": "tiny",
        "status": UsageStatus.OK,
        "created_at": datetime(2026, 1, 1, tzinfo=UTC),
    }
    fields.update(overrides)
    return UsageEvent.model_validate(fields)


def test_row_has_one_value_per_column_with_absent_strings_empty() -> None:
    row = dict(zip(USAGE_COLUMNS, usage_row(_event(), CHARGE), strict=True))

    assert row["tenant_id"] == "acme"
    assert row["worker_id"] == ""
    assert row["finish_reason"] == ""
    assert row["error_code"] == ""
    assert row["ttft_ms"] is None  # "no first token" stays distinct from 0 ms
    assert row["status"] == "ok"


def test_enums_are_stored_as_their_values() -> None:
    row = dict(
        zip(
            USAGE_COLUMNS,
            usage_row(_event(status=UsageStatus.FAILED, finish_reason=FinishReason.ERROR), CHARGE),
            strict=True,
        )
    )

    assert (row["status"], row["finish_reason"]) == ("failed", "error")


def test_timestamps_are_utc_and_naive_ones_are_taken_as_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    event = _event(
        created_at=datetime(2026, 1, 1, 12, 0),
        finished_at=datetime(2026, 1, 1, 14, 0, tzinfo=plus_two),
    )
    row = dict(zip(USAGE_COLUMNS, usage_row(event, CHARGE), strict=True))

    assert row["created_at"] == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert row["finished_at"] == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert row["finished_at"].tzinfo is UTC


@pytest.mark.parametrize("value", [-1, 2**32])
@pytest.mark.parametrize(
    "field", ["attempt", "num_prompt_tokens", "num_completion_tokens", "num_cached_tokens"]
)
def test_counts_out_of_their_columns_range_cannot_be_stored(field: str, value: int) -> None:
    with pytest.raises(UnstorableEvent, match=f"{field} must .* got {value}"):
        usage_row(_event(**{field: value}), CHARGE)
    usage_row(_event(**{field: 2**32 - 1}), CHARGE)  # the column's largest value is fine


def test_the_charge_and_the_new_usage_fields_have_columns() -> None:
    event = _event(overload_tier=2, precision="int8", flags=["max_tokens_capped"])
    row = dict(zip(USAGE_COLUMNS, usage_row(event, CHARGE), strict=True))

    assert (row["overload_tier"], row["precision"], row["flags"]) == (
        2,
        "int8",
        ["max_tokens_capped"],
    )
    assert (row["cost_weight"], row["cost_units"], row["billed_units"], row["price_version"]) == (
        1.2,
        Decimal("0.5"),
        Decimal("0.25"),
        3,
    )


def _by_column(rows: list[tuple[object, ...]]) -> list[list[object]]:
    """The rows by column, timestamps as DateTime64(3) ticks, as the store writes them."""
    columns = [list(column) for column in zip(*rows, strict=True)]
    for name in ("created_at", "finished_at"):
        index = USAGE_COLUMNS.index(name)
        columns[index] = [ticks(at) for at in columns[index]]
    for name in ("cost_units", "billed_units"):  # in nano-units, as the table holds them
        index = USAGE_COLUMNS.index(name)
        columns[index] = [int(cost.scaleb(9)) for cost in columns[index]]
    return columns


def _nanos(charge: Charge) -> NanoCharge:
    return (
        charge.cost_weight,
        int(charge.cost_units.scaleb(9)),
        int(charge.billed_units.scaleb(9)),
        charge.price_version,
    )


def test_columns_hold_the_values_of_the_rows() -> None:
    plus_two = timezone(timedelta(hours=2))
    events = [
        _event(),
        _event(
            request_id="req_2",
            adapter="sql",
            worker_id="w1",
            status=UsageStatus.FAILED,
            finish_reason=FinishReason.ERROR,
            error_code="oom",
            ttft_ms=3.5,
            flags=["injection_suspected"],
            key_sha256="ab" * 32,
            created_at=datetime(2026, 1, 1, 12, 0, 0, 123_999),  # naive: UTC
            finished_at=datetime(2026, 1, 1, 14, 0, 1, 1_500, tzinfo=plus_two),
        ),
        _event(request_id="req_3", status=UsageStatus.CANCELLED, finish_reason=FinishReason.STOP),
    ]
    charges = [CHARGE, CHARGE._replace(cost_units=Decimal("0.75")), CHARGE]

    columns = usage_columns(events, [_nanos(c) for c in charges])

    rows = [usage_row(e, c) for e, c in zip(events, charges, strict=True)]
    assert [list(column) for column in columns] == _by_column(rows)
    assert len(columns) == len(USAGE_COLUMNS)


def test_columns_of_aware_events_alone_are_the_same_ticks() -> None:
    events = [
        _event(created_at=datetime(2026, 1, 1, 0, 0, 0, n * 777, tzinfo=UTC)) for n in range(5)
    ]

    columns = usage_columns(events, [_nanos(CHARGE)] * 5)

    assert [list(c) for c in columns] == _by_column([usage_row(e, CHARGE) for e in events])


def test_columns_of_nothing_are_empty_and_a_count_out_of_range_is_refused() -> None:
    assert usage_columns([], []) == [[] for _ in USAGE_COLUMNS]
    with pytest.raises(UnstorableEvent, match="num_cached_tokens"):
        usage_columns([_event(), _event(num_cached_tokens=-1)], [_nanos(CHARGE)] * 2)
    with pytest.raises(UnstorableEvent, match="num_completion_tokens"):
        usage_columns([_event(), _event(num_completion_tokens=2**32)], [_nanos(CHARGE)] * 2)


@pytest.mark.parametrize(
    "at",
    [
        datetime(2026, 3, 1, 12, 0, 0, 999, tzinfo=UTC),
        datetime(2026, 3, 1, 14, 0, 0, 1_500, tzinfo=timezone(timedelta(hours=2))),
        datetime(2026, 3, 1, 12, 0, 0, 123_456),  # naive: UTC
        datetime(1969, 12, 31, 23, 59, 59, 999_500, tzinfo=UTC),
    ],
)
def test_millis_are_the_ticks_of_the_store(at: datetime) -> None:
    assert millis([at, at]) == [ticks(at), ticks(at)]


def test_a_batch_line_keeps_its_batch_id_and_other_rows_read_empty() -> None:
    events = [_event(batch_id="batch_01"), _event(request_id="req_2")]

    rows = [dict(zip(USAGE_COLUMNS, usage_row(e, CHARGE), strict=True)) for e in events]
    columns = usage_columns(events, [_nanos(CHARGE)] * 2)

    assert [row["batch_id"] for row in rows] == ["batch_01", ""]
    assert columns[USAGE_COLUMNS.index("batch_id")] == ["batch_01", ""]
