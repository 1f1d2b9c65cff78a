from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from billing.pricing import Charge
from billing.rows import USAGE_COLUMNS, UnstorableEvent, usage_row
from schemas import FinishReason, UsageEvent, UsageStatus

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


@pytest.mark.parametrize("field", ["attempt", "num_prompt_tokens", "num_cached_tokens"])
def test_negative_counts_cannot_be_stored(field: str) -> None:
    with pytest.raises(UnstorableEvent, match=field):
        usage_row(_event(**{field: -1}), CHARGE)


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
