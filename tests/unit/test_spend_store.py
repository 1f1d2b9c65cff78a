"""The job's budget store over Faust tables (dicts standing in): a new store over the
same tables, as after a restart's changelog recovery, has the same spend, reservations
and fired thresholds, summed across tenants for a model's budget."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from stream_jobs.app import TableSpendStore
from stream_jobs.budgets import Budget, Period, due_thresholds, held_in, reserve, settle

AT = datetime(2026, 3, 15, tzinfo=UTC)
MODEL = Budget("model:m|month@UTC", "model:m", 1000, Period.parse("month"))


def store_over(*tables: dict[bytes, bytes]) -> TableSpendStore:
    return TableSpendStore(*(cast(Any, t) for t in tables))


def test_a_restarted_store_resumes_with_the_same_spend() -> None:
    tables: tuple[dict[bytes, bytes], ...] = ({}, {}, {})
    store = store_over(*tables)
    assert reserve(store, [MODEL], "a", "r1", 600, AT).admitted
    assert reserve(store, [MODEL], "b", "r1", 300, AT).admitted
    settle(store, "a", "r1", 500, keep_until=10.0)
    for threshold in due_thresholds(store, MODEL, AT):
        store.fire("a", MODEL.budget_id, "2026-03-01", threshold)

    again = store_over(*tables)
    assert held_in(again, MODEL, AT) == (800, 500)
    assert due_thresholds(again, MODEL, AT) == []  # 50% fired before the restart
    assert reserve(again, [MODEL], "a", "r1", 600, AT).known  # not charged twice
    assert not reserve(again, [MODEL], "c", "r1", 201, AT).admitted
    assert settle(again, "a", "r1", 500, keep_until=10.0) == ()  # a redelivered usage
    again.sweep("a", now=11.0)
    assert again.reservation("a", "r1") is None and again.reservation("b", "r1") is not None
    again.forget()
    assert held_in(again, MODEL, AT) == (800, 500)
