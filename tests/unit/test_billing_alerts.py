"""Budget alerts in ClickHouse: the table's key, each alert once, the dashboard's query."""

from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from billing.alert_sink import write_alerts
from billing.queries import dashboard_query
from billing.storage import ClickHouseStore
from schemas.budgets import BudgetAlert

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def alert(tenant: str, threshold: int, minute: int = 0, entity: str = "") -> BudgetAlert:
    entity = entity or f"tenant:{tenant}"
    budget_id = f"{entity}|month@UTC"
    return BudgetAlert(
        alert_id=f"{budget_id}|2026-03-01|{threshold}",
        budget_id=budget_id,
        entity=entity,
        tenant_id=tenant,
        period_start=datetime(2026, 3, 1, tzinfo=UTC),
        period_end=datetime(2026, 4, 1, tzinfo=UTC),
        threshold=threshold,
        limit_units="2",
        spent_units=str(Decimal(threshold) / 50),
        enforce="hard",
        reason="refused" if threshold == 100 else "threshold",
        fired_at=T0.replace(minute=minute),
    )


@pytest.fixture
def store() -> Iterator[ClickHouseStore]:
    with ClickHouseStore("chdb://memory") as store:
        yield store


def test_the_alerts_table_is_keyed_tenant_first(store: ClickHouseStore) -> None:
    [table] = store.query(
        "SELECT sorting_key, engine FROM system.tables WHERE name = 'budget_alerts'"
    )
    assert (table["sorting_key"], table["engine"]) == ("tenant_id, alert_id", "ReplacingMergeTree")


def test_each_alert_is_one_row_however_often_it_is_delivered(store: ClickHouseStore) -> None:
    alerts = [alert("acme", 50), alert("acme", 80, 1), alert("beta", 100, 2)]
    assert write_alerts(store, [*alerts, alerts[0]]) == 3  # a repeat within the batch
    assert write_alerts(store, alerts[1:]) == 0  # a redelivered batch
    assert write_alerts(store, [alert("acme", 95, 3)]) == 1
    # Plain reads, no FINAL: one row per alert.
    rows = store.query("SELECT alert_id, spent_units FROM budget_alerts ORDER BY alert_id")
    assert len(rows) == 4
    assert rows[0]["spent_units"] == Decimal("1.000000000")  # exact decimals


def test_the_same_block_again_with_its_token_lands_once(store: ClickHouseStore) -> None:
    # The one case the key lookup cannot answer: an insert that landed, its ack lost.
    from billing.alert_rows import alert_row

    rows = [alert_row(alert("acme", 50))]
    store.insert_alerts(rows, dedup_token="t1")
    store.insert_alerts(rows, dedup_token="t1")
    assert store.query("SELECT count() AS n FROM budget_alerts") == [{"n": 1}]


def test_recent_alerts_are_newest_first_and_limited_per_tenant(store: ClickHouseStore) -> None:
    write_alerts(store, [alert("acme", t, m) for m, t in enumerate((50, 80, 95, 100))])
    write_alerts(store, [alert("beta", 50, 9), alert("beta", 50, 9, entity="model:m")])
    sql, values = dashboard_query("recent_budget_alerts").to_sql(
        {"since": "2026-03-01 00:00:00", "until": "2026-03-02 00:00:00", "limit": "2"}
    )
    rows = store.query(sql, values)
    assert [(r["tenant_id"], r["threshold"]) for r in rows] == [
        ("acme", 100),
        ("acme", 95),
        ("beta", 50),
        ("beta", 50),
    ]
    sql, values = dashboard_query("recent_budget_alerts").to_sql(
        {"tenant": "beta", "since": "2026-03-02 00:00:00"}
    )
    assert store.query(sql, values) == []  # outside the window
