"""The Grafana dashboard JSON: generated from the query files, and checked in up to date."""

import json
import re

from billing.grafana import grafana_dashboard, grafana_sql, render
from billing.queries import DASHBOARDS_DIR, dashboard_queries, dashboard_query


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

    assert "tenant_id = ${tenant:sqlstring}" in sql
    assert "first_created_at < $__toTime" in sql
    assert "last_finished_at >= $__fromTime" in sql
    assert "LIMIT ${limit:raw}" in sql
