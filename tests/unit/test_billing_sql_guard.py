import pytest

from billing.sql_guard import read_only_problem


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1",
        "  select count() FROM usage_events FINAL;",
        "WITH t AS (SELECT 1) SELECT * FROM t",
        "SHOW TABLES",
        "DESCRIBE TABLE usage_events",
        "desc usage_events",
        "-- why\n/* and how */ SELECT 1 -- trailing\n",
        "SELECT 'a;b', \"c;d\", `e;f` FROM t WHERE x = 'it''s; fine' AND y = 'q\\';'",
        "SELECT 1; -- only a comment after the end",
        "SELECT 'INTO OUTFILE' AS into, outfile FROM t",
    ],
)
def test_single_read_only_statements_pass(sql: str) -> None:
    assert read_only_problem(sql) is None


@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("", "empty query"),
        ("  -- nothing\n", "empty query"),
        ("INSERT INTO usage_events VALUES (1)", "not INSERT"),
        ("DROP TABLE usage_events", "not DROP"),
        ("/* SELECT */ ALTER TABLE t DELETE WHERE 1", "not ALTER"),
        ("SELECTx 1", "not SELECTX"),
        ("(SELECT 1)", "not ("),
        ("SELECT 1; DROP TABLE usage_events", "one statement"),
        ("SELECT ';' ; SELECT 2", "one statement"),
        ("SELECT 1;;", "one statement"),
        ("SELECT 1 into  outfile '/tmp/x'", "INTO OUTFILE"),
        ("SELECT 1 INTO /* hidden */ OUTFILE '/tmp/x'", "INTO OUTFILE"),
    ],
)
def test_everything_else_is_refused_with_a_reason(sql: str, reason: str) -> None:
    problem = read_only_problem(sql)

    assert problem is not None
    assert reason in problem
