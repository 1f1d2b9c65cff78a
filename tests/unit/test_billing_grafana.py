"""The Grafana dashboard JSON: generated from the query files, and checked in up to date."""

import json
import re
from datetime import UTC, datetime
from urllib.parse import quote

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from billing.dedup import write_usage
from billing.grafana import grafana_dashboard, grafana_sql, render
from billing.queries import DASHBOARDS_DIR, dashboard_queries, dashboard_query
from billing.storage import ClickHouseStore
from schemas import UsageEvent, UsageStatus
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer


def test_the_checked_in_json_is_the_generated_one() -> None:
    checked_in = (DASHBOARDS_DIR / "grafana.json").read_text()

    assert checked_in == render(), (
        "run: python -m billing.grafana > billing/dashboards/grafana.json"
    )


def test_one_clickhouse_panel_per_query_with_no_placeholder_left() -> None:
    dashboard = grafana_dashboard()
    queries = dashboard_queries()

    assert [p["title"] for p in dashboard["panels"]] == [q.title for q in queries.values()]
    for panel in dashboard["panels"]:
        [target] = panel["targets"]
        assert target["datasource"]["type"] == "grafana-clickhouse-datasource"
        assert not re.search(r"(?<!\$)\{\w+:[^{}]+\}", target["rawSql"]), panel["title"]
        assert "--" not in target["rawSql"]  # the header stays out of the panel
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["tenant"]["query"] == ""
    assert variables["limit"]["query"] == "20"
    assert variables["datasource"]["type"] == "datasource"
    json.dumps(dashboard)  # plain JSON all the way down


def test_placeholders_become_the_time_picker_and_escaped_variables() -> None:
    sql = grafana_sql(dashboard_query("top_sessions_by_cost"))

    assert "tenant_id = decodeURLComponent('${tenant:percentencode}')" in sql
    assert "first_created_at < $__toTime" in sql
    assert "last_finished_at >= $__fromTime" in sql
    assert "LIMIT CAST(decodeURLComponent('${limit:percentencode}') AS UInt32)" in sql
    assert ":raw}" not in render()  # no variable is pasted into SQL as typed


def as_grafana_would(sql: str, values: dict[str, str]) -> str:
    """Grafana's interpolation: ``sqlstring`` doubles quotes, ``percentencode`` is
    RFC 3986 (``encodeURIComponent`` with ``!'()*`` too), ``raw`` is the text as typed,
    the time macros are times."""

    def replace(match: re.Match[str]) -> str:
        value = values[match[1]]
        if match[2] == "sqlstring":
            return "'" + value.replace("'", "''") + "'"
        if match[2] == "percentencode":
            return quote(value, safe="")
        assert match[2] == "raw"
        return value

    sql = sql.replace("$__fromTime", "toDateTime64('2026-01-01 00:00:00', 3, 'UTC')")
    sql = sql.replace("$__toTime", "toDateTime64('2027-01-01 00:00:00', 3, 'UTC')")
    return re.sub(r"\$\{(\w+):(\w+)\}", replace, sql)


def two_tenants() -> list[UsageEvent]:
    at = datetime(2026, 3, 1, 12, tzinfo=UTC)
    return [
        UsageEvent(
            request_id=f"r_{tenant}", session_id="s", tenant_id=tenant, model="tiny",
            status=UsageStatus.OK, num_prompt_tokens=10, created_at=at,
        )
        for tenant in ("acme", "globex")
    ]  # fmt: skip


UNION = (
    "20 UNION ALL SELECT tenant_id, session_id, sum(billed_units), sum(cost_units), count(),"
    " 0, sum(prompt_tokens), sum(completion_tokens), min(created_at), max(finished_at)"
    " FROM usage_events GROUP BY tenant_id, session_id"
)


@pytest.mark.parametrize("limit", [UNION, "1) UNION ALL (SELECT 1", "\\' OR 1=1 --", "-1", "x"])
def test_a_typed_variable_that_is_not_of_its_type_fails_the_query(limit: str) -> None:
    with ClickHouseStore("chdb://memory") as store:
        write_usage(store, two_tenants(), Pricer(read_price_book(BUNDLED_PRICES)))
        sql = grafana_sql(dashboard_query("top_sessions_by_cost"))

        [row] = store.query(as_grafana_would(sql, {"tenant": "acme", "limit": "20"}))
        assert row["tenant_id"] == "acme"
        with pytest.raises(DatabaseError, match=r"(?i)parse"):
            # pasted as typed, the other tenant's rows came back with acme's
            store.query(as_grafana_would(sql, {"tenant": "acme", "limit": limit}))


def test_a_text_variable_cannot_end_its_string_literal() -> None:
    # sqlstring doubles quotes only; ClickHouse reads \' as a quote inside the literal,
    # so the quote after it ended the literal and the rest was SQL
    escape = "\\' = '' ) OR 1=1 --"
    sql = grafana_sql(dashboard_query("spend_by_tenant_per_day"))
    with ClickHouseStore("chdb://memory") as store:
        write_usage(store, two_tenants(), Pricer(read_price_book(BUNDLED_PRICES)))
        for tenant in ("acme", escape, "o'brien"):
            rows = store.query(as_grafana_would(sql, {"tenant": tenant}))
            assert {row["tenant_id"] for row in rows} <= {"acme"}, tenant


def test_a_decimal_variable_is_read_as_its_type() -> None:
    sql = grafana_sql(dashboard_query("budget_vs_actual"))
    assert "CAST(decodeURLComponent('${budget:percentencode}') AS Decimal(38, 9))" in sql
    values = {"tz": "UTC", "period": "month", "tenant": "acme", "model": "", "budget": "12.5"}
    with ClickHouseStore("chdb://memory") as store:
        assert store.query(as_grafana_would(sql, values)) == []  # nothing spent yet: no rows
        with pytest.raises(DatabaseError):
            store.query(as_grafana_would(sql, {**values, "budget": "12.5 AS budget_units, 1"}))
