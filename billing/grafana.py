"""The Grafana dashboard: one panel per dashboard query, for the ClickHouse data source.

``python -m billing.grafana > billing/dashboards/grafana.json`` regenerates the checked-in
file from ``billing/dashboards/*.sql``; a unit test keeps the two in step. Placeholders
become Grafana's: ``since``/``until`` the time picker (``$__fromTime``/``$__toTime`` of
grafana-clickhouse-datasource), text parameters the variable's text as a string literal
that no text can end (``_literal``), the rest a cast of that text to the parameter's
type, so a value that is not of the type fails the panel's query instead of becoming
SQL; each is a dashboard variable with the query's default.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from billing.queries import DashboardQuery, dashboard_queries

DATASOURCE = {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}
TIME_MACROS = {"since": "$__fromTime", "until": "$__toTime"}
_PLACEHOLDER = re.compile(r"\{(\w+):([^{}]+)\}")
_FORMAT_TIME_SERIES, _FORMAT_TABLE = 0, 1

# How each question is best drawn; a query not listed here gets a table.
_PANELS: dict[str, dict[str, Any]] = {
    "spend_by_tenant_per_day": {
        "type": "barchart",
        "options": {"stacking": "normal", "xField": "day"},
        "transformations": [
            {
                "id": "groupingToMatrix",
                "options": {
                    "columnField": "tenant_id",
                    "rowField": "day",
                    "valueField": "billed_units",
                },
            }
        ],
    },
    "tokens_per_minute_by_tenant": {
        "type": "timeseries",
        "format": _FORMAT_TIME_SERIES,
        "fieldConfig": {"defaults": {"unit": "short"}, "overrides": []},
    },
    "failed_cancelled_share": {
        "type": "bargauge",
        "options": {
            "displayMode": "basic",
            "orientation": "horizontal",
            "reduceOptions": {"values": True, "calcs": [], "fields": "/^cost_share$/"},
        },
        "fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1}, "overrides": []},
    },
    "cost_per_1k_by_context_bucket": {
        "type": "barchart",
        "options": {"xField": "context_from"},
    },
}


def grafana_sql(query: DashboardQuery) -> str:
    """The query's SQL with its ``{name:Type}`` placeholders in Grafana's terms."""

    def replace(match: re.Match[str]) -> str:
        name, type_ = match[1], match[2].strip()
        if name in TIME_MACROS:
            return TIME_MACROS[name]
        if type_ == "String":
            return _literal(name)
        return f"CAST({_literal(name)} AS {type_})"

    body = [line for line in query.sql.splitlines() if not line.startswith("--")]
    return _PLACEHOLDER.sub(replace, "\n".join(body)).strip()


def _literal(name: str) -> str:
    """Variable ``name``'s text as a ClickHouse string literal, whatever the text.

    Percent-encoded (Grafana's ``percentencode``: RFC 3986, quotes and backslashes
    included), the text holds neither, so it cannot end the literal; ``sqlstring`` only
    doubles quotes, and ClickHouse reads a backslash before one as an escape.
    """
    return f"decodeURLComponent('${{{name}:percentencode}}')"


def grafana_dashboard() -> dict[str, Any]:
    queries = dashboard_queries()
    panels = [_panel(query, n) for n, query in enumerate(queries.values())]
    variables: dict[str, str] = {}
    for query in queries.values():
        for param in query.params:
            if param.name not in TIME_MACROS:
                variables.setdefault(param.name, param.default)
    return dashboard(
        title="tokenbus billing",
        uid="tokenbus-billing",
        description="Usage and cost per tenant from tokenbus (billing/dashboards/*.sql).",
        tag="billing",
        since="now-24h",
        refresh="1m",
        datasource=("ClickHouse", DATASOURCE["type"]),
        variables=[
            {
                "name": name,
                "label": name,
                "type": "textbox",
                "query": default,
                "current": {"text": default, "value": default},
            }
            for name, default in variables.items()
        ],
        panels=panels,
    )


def dashboard(
    *,
    title: str,
    uid: str,
    description: str,
    tag: str,
    since: str,
    refresh: str,
    datasource: tuple[str, str],
    variables: list[dict[str, Any]],
    panels: list[dict[str, Any]],
) -> dict[str, Any]:
    """A tokenbus dashboard in Grafana's JSON model: its data source as the first
    variable (``datasource``: its label and plugin type), then ``variables``."""
    label, plugin = datasource
    return {
        "title": title,
        "uid": uid,
        "description": description,
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "tags": ["tokenbus", tag],
        "time": {"from": since, "to": "now"},
        "refresh": refresh,
        "templating": {
            "list": [
                {"name": "datasource", "label": label, "type": "datasource", "query": plugin},
                *variables,
            ]
        },
        "panels": panels,
    }


def _panel(query: DashboardQuery, n: int) -> dict[str, Any]:
    shape = dict(_PANELS.get(query.name, {"type": "table"}))
    query_format = shape.pop("format", _FORMAT_TABLE)
    return {
        "id": n + 1,
        "title": query.title,
        "description": query.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 9, "w": 12, "x": 12 * (n % 2), "y": 9 * (n // 2)},
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {},
        **shape,
        "targets": [
            {
                "refId": "A",
                "datasource": DATASOURCE,
                "editorType": "sql",
                "queryType": "timeseries" if query_format == _FORMAT_TIME_SERIES else "table",
                "format": query_format,
                "rawSql": grafana_sql(query),
            }
        ],
    }


def render() -> str:
    return json.dumps(grafana_dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
