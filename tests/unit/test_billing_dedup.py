"""Which events of a batch are new attempts, and the token of their insert."""

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from billing.dedup import (
    SUPERSEDED,
    Stored,
    dedup_token,
    first_copies,
    later_runs,
    plan_keyed_columns,
    usage_key,
    write_usage,
)
from billing.rows import USAGE_COLUMNS
from billing.usage_codec import decode_usage
from schemas import UsageEvent, UsageStatus, encode
from tests.unit.usage_rows import plan_insert, plan_keyed_insert, ticks
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer

PRICER = Pricer(read_price_book(BUNDLED_PRICES))
_STATUS = USAGE_COLUMNS.index("status")
_FLAGS = USAGE_COLUMNS.index("flags")


def _event(request: str, attempt: int = 0, **overrides: object) -> UsageEvent:
    fields: dict[str, object] = {
        "request_id": request,
        "session_id": "sess_1",
        "tenant_id": "acme",
        "model": "tiny",
        "attempt": attempt,
        "status": UsageStatus.OK,
        "num_prompt_tokens": 10,
        "created_at": datetime(2026, 1, 1, tzinfo=UTC),
    }
    fields.update(overrides)
    return UsageEvent.model_validate(fields)


def test_the_key_is_tenant_session_request_attempt() -> None:
    assert usage_key(_event("r", 2)) == ("acme", "sess_1", "r", 2)


def test_first_copies_keep_the_first_of_each_attempt_in_order() -> None:
    a, b, a_again, a_retry = (
        _event("a"),
        _event("b"),
        _event("a", num_prompt_tokens=99),
        _event("a", 1),
    )

    assert first_copies([a, b, a_again, a_retry, b]) == [a, b, a_retry]


def test_the_token_depends_on_the_keys_not_their_order_or_values() -> None:
    keys = [usage_key(_event("a")), usage_key(_event("b"))]

    assert dedup_token(keys) == dedup_token(reversed(keys))
    assert dedup_token(keys) != dedup_token(keys[:1])
    assert dedup_token(keys).startswith("usage-")
    # Field boundaries are marked: ("ab", "c") and ("a", "bc") differ.
    assert dedup_token([("t", "ab", "c", 0)]) != dedup_token([("t", "a", "bc", 0)])


def test_a_plan_leaves_out_known_attempts_and_prices_the_rest() -> None:
    events = [_event("a"), _event("b"), _event("c")]

    plan = plan_insert(events, {usage_key(events[1])}, PRICER)

    assert [row[USAGE_COLUMNS.index("request_id")] for row in plan.rows] == ["a", "c"]
    assert plan.num_known == 1
    assert plan.dedup_token == dedup_token([usage_key(events[0]), usage_key(events[2])])
    cost = USAGE_COLUMNS.index("cost_units")
    assert plan.rows[0][cost] == PRICER.charge(events[0]).cost_units


class MemoryStore:
    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.num_lookups = 0

    def look_up(self, keys: Sequence[tuple[str, str, str, int]]) -> Stored:
        self.num_lookups += 1
        requests = {key[:3] for key in keys}
        billed = {
            (r[0], r[1], r[2])
            for r in self.rows
            if (r[0], r[1], r[2]) in requests
            and r[_STATUS] != "rejected"
            and SUPERSEDED not in r[_FLAGS]
        }
        return Stored(set(keys) & {tuple(r[:4]) for r in self.rows}, billed)

    def insert_columns(self, columns: Sequence[Sequence[Any]], *, dedup_token: str) -> None:
        self.rows.extend(zip(*columns, strict=True))


def test_write_usage_stores_each_attempt_once_across_calls() -> None:
    store = MemoryStore()
    write_usage(store, [_event("a"), _event("b"), _event("a")], PRICER)
    plan = write_usage(store, [_event("b"), _event("c")], PRICER)

    assert [row[2] for row in store.rows] == ["a", "b", "c"]
    assert plan.num_known == 1
    assert write_usage(store, [], PRICER).num_rows == 0
    assert store.num_lookups == 2  # nothing to look up for an empty batch


def test_a_column_plan_is_the_row_plan_by_column() -> None:
    elsewhere = datetime(2026, 1, 1, 2, 0, 1, 1_500, tzinfo=timezone(timedelta(hours=2)))
    events = [
        decode_usage(encode(e))
        for e in [
            _event("a"),
            _event("b", status=UsageStatus.FAILED, created_at=elsewhere),
            _event("c", adapter="sql", num_completion_tokens=7),
        ]
    ]
    keyed = [(usage_key(e), e) for e in events]

    for existing in (set(), {usage_key(events[1])}):
        rows = plan_keyed_insert(keyed, existing, PRICER)
        columns = plan_keyed_columns(keyed, existing, PRICER)

        assert columns.dedup_token == rows.dedup_token
        assert columns.num_known == rows.num_known
        assert columns.num_rows == len(rows.rows)
        assert columns.keys == [key for key, _ in rows.attempts]
        assert columns.created_ticks == [ticks(at) for _, at in rows.attempts]
        by_column = [list(column) for column in zip(*rows.rows, strict=True)]
        for name in ("created_at", "finished_at"):
            index = USAGE_COLUMNS.index(name)
            by_column[index] = [ticks(at) for at in by_column[index]]
        for name in ("cost_units", "billed_units"):  # in nano-units, as the table holds them
            index = USAGE_COLUMNS.index(name)
            by_column[index] = [int(cost.scaleb(9)) for cost in by_column[index]]
        assert [list(column) for column in columns.columns] == by_column


def test_a_column_plan_of_known_attempts_alone_is_empty() -> None:
    events = [_event("a")]
    keyed = [(usage_key(e), e) for e in events]

    plan = plan_keyed_columns(keyed, {usage_key(events[0])}, PRICER)

    assert (plan.num_rows, plan.num_known, plan.keys) == (0, 1, [])
    assert plan.dedup_token == dedup_token([])


def _keyed(*events: UsageEvent) -> list[tuple[tuple[str, str, str, int], UsageEvent]]:
    return [(usage_key(e), e) for e in events]


def test_later_runs_of_a_request_are_those_after_its_first_run() -> None:
    keyed = _keyed(
        _event("a", 1),
        _event("b", 0, status=UsageStatus.REJECTED),
        _event("a", 0),
        _event("b", 1),
        _event("c", 0),
        _event("a", 2, status=UsageStatus.CANCELLED),
    )

    assert later_runs(keyed) == [2, 5]  # b's refusal ran nothing: its attempt 1 is billed
    assert later_runs(keyed, {("acme", "sess_1", "c")}) == [2, 4, 5]
    assert later_runs(_keyed(_event("a"), _event("b"))) == []


def test_a_superseded_run_keeps_its_cost_and_is_billed_nothing() -> None:
    events = [decode_usage(encode(e)) for e in (_event("a", 1), _event("a", 0), _event("b"))]
    keyed = [(usage_key(e), e) for e in events]

    plan = plan_keyed_columns(keyed, set(), PRICER, {("acme", "sess_1", "b")})

    rows = [dict(zip(USAGE_COLUMNS, row, strict=True)) for row in zip(*plan.columns, strict=True)]
    assert [(r["request_id"], r["attempt"]) for r in rows] == [("a", 1), ("a", 0), ("b", 0)]
    assert [SUPERSEDED in r["flags"] for r in rows] == [False, True, True]
    assert [r["billed_units"] for r in rows] == [rows[0]["cost_units"], 0, 0]
    assert rows[1]["cost_units"] == rows[0]["cost_units"] > 0
    assert plan.num_rows == 3 and plan.num_known == 0
