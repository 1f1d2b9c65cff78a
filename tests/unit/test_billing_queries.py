"""The dashboard query files: headers, parameters, and the rules every file keeps."""

import re
from pathlib import Path

import pytest

from billing.queries import (
    DASHBOARDS_DIR,
    QueryParamError,
    dashboard_queries,
    dashboard_query,
    main,
    parse_query,
)

QUESTIONS = {
    "spend_by_tenant_per_day",
    "tokens_per_minute_by_tenant",
    "top_sessions_by_cost",
    "failed_cancelled_share",
    "cost_per_1k_by_context_bucket",
    "ttft_by_tenant_and_priority",
    "spend_by_adapter",
    "spend_per_batch",
    "budget_vs_actual",
    "recent_budget_alerts",
}
GOOD = """-- Title here
-- What it answers,
-- over two lines.
-- @param tenant = ""  one tenant, or all
-- @param limit = 20  rows
SELECT * FROM t WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
LIMIT {limit:UInt32}
"""


def test_there_is_one_file_per_question() -> None:
    assert set(dashboard_queries()) == QUESTIONS


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_every_file_has_a_title_a_description_and_a_tenant_filter(name: str) -> None:
    query = dashboard_query(name)

    assert query.title and query.description
    assert [p.name for p in query.params][:3] == ["tenant", "since", "until"]
    assert all(p.description for p in query.params)
    # Tenant first in every predicate: the WHERE clause opens with the tenant filter.
    where = re.search(r"\n\s*WHERE (.*)", query.sql)
    assert where is not None
    assert where[1].startswith("({tenant:String} = '' OR tenant_id = {tenant:String})")


def test_a_header_is_parsed_into_title_description_and_parameters() -> None:
    query = parse_query("q", GOOD)

    assert query.title == "Title here"
    assert query.description == "What it answers, over two lines."
    assert [(p.name, p.type, p.default, p.description) for p in query.params] == [
        ("tenant", "String", "", "one tenant, or all"),
        ("limit", "UInt32", "20", "rows"),
    ]


def test_to_sql_fills_defaults_and_takes_overrides() -> None:
    query = parse_query("q", GOOD)

    assert query.to_sql() == (GOOD, {"tenant": "", "limit": "20"})
    assert query.to_sql({"limit": "5"})[1] == {"tenant": "", "limit": "5"}
    with pytest.raises(QueryParamError, match="q has no parameter colour; it takes tenant, limit"):
        query.to_sql({"colour": "red"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("SELECT 1", "must start with a -- title"),
        ("-- t\nSELECT {x:UInt8}", "placeholders \\['x'\\] but @param lines for \\[\\]"),
        ("-- t\n-- @param x = 1\nSELECT 1", "placeholders \\[\\] but @param lines for \\['x'\\]"),
        ("-- t\n-- @param x = one\nSELECT {x:UInt8}", "not JSON"),
        ("-- t\n-- @param x = [1]\nSELECT {x:UInt8}", "string or a number"),
        ("-- t\n-- @param x = 1\nSELECT {x:UInt8} + {x:UInt16}", "both UInt8 and UInt16"),
    ],
)
def test_inconsistent_files_are_refused(text: str, message: str) -> None:
    with pytest.raises(QueryParamError, match=message):
        parse_query("q", text)


def test_an_unknown_name_lists_the_known_ones(tmp_path: Path) -> None:
    (tmp_path / "only.sql").write_text(GOOD)

    with pytest.raises(QueryParamError, match="no dashboard query 'nope'; there are: only"):
        dashboard_query("nope", tmp_path)


def test_the_files_ship_with_the_package() -> None:
    assert DASHBOARDS_DIR.is_dir()
    assert (DASHBOARDS_DIR / "grafana.json").is_file()


def test_an_include_line_takes_a_parts_lines_at_its_indent(tmp_path: Path) -> None:
    (tmp_path / "_totals.sql").write_text("-- what they are\nsum(a) AS a,\ncount() AS n\n")
    (tmp_path / "q.sql").write_text(
        '-- Title\n-- @param tenant = ""  one\nSELECT\n    k,\n    -- @include totals\n'
        "FROM t WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})\n"
    )

    assert list(dashboard_queries(tmp_path)) == ["q"]  # a part is not a query
    assert dashboard_query("q", tmp_path).sql == (
        '-- Title\n-- @param tenant = ""  one\nSELECT\n    k,\n    sum(a) AS a,\n'
        "    count() AS n\nFROM t WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})\n"
    )


def test_an_include_of_no_part_is_refused(tmp_path: Path) -> None:
    (tmp_path / "q.sql").write_text("-- Title\nSELECT\n    -- @include nothing\nFROM t\n")

    with pytest.raises(QueryParamError, match=r"q: no _nothing\.sql to include"):
        dashboard_query("q", tmp_path)


def test_every_include_in_the_shipped_files_is_filled() -> None:
    for query in dashboard_queries().values():
        assert "@include" not in query.sql, query.name
    assert "countIf(status = 'failed') AS num_failed," in dashboard_query("spend_per_batch").sql


def test_the_module_prints_a_query_whole(capsys: pytest.CaptureFixture[str]) -> None:
    main(["top_sessions_by_cost"])

    assert capsys.readouterr().out == dashboard_query("top_sessions_by_cost").sql
    with pytest.raises(SystemExit, match="no dashboard query 'nope'"):
        main(["nope"])
