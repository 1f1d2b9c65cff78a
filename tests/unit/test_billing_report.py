from datetime import UTC, datetime, timedelta, timezone

import pytest

from billing.report import BatchTotals, SessionTotals, TenantTotals


def _clause(sql: str, keyword: str) -> str:
    """The text of one clause: from ``keyword`` to the next newline-started clause."""
    start = sql.index(keyword)
    rest = sql[start + len(keyword) :]
    ends = [rest.find(f"\n{k}") for k in ("GROUP BY", "ORDER BY", "LIMIT")]
    end = min((e for e in ends if e >= 0), default=len(rest))
    return rest[:end].strip()


def test_tenant_totals_without_filters_reads_every_tenant_deduplicated() -> None:
    sql, parameters = TenantTotals().to_sql()

    assert "FROM usage_events FINAL" in sql
    assert "WHERE" not in sql
    assert _clause(sql, "GROUP BY") == "tenant_id"
    assert _clause(sql, "ORDER BY") == "tenant_id"
    assert parameters == {}


def test_tenant_totals_filters_tenant_first_through_parameters() -> None:
    since = datetime(2026, 1, 2, 3, 4, 5, 678_999, tzinfo=UTC)
    until = since + timedelta(days=1)
    sql, parameters = TenantTotals(tenant_id="acme' OR 1=1 --", since=since, until=until).to_sql()

    where = _clause(sql, "WHERE").split("\n  AND ")
    assert where == [
        "tenant_id = {tenant_id:String}",
        "created_at >= {since:DateTime64(3, 'UTC')}",
        "created_at < {until:DateTime64(3, 'UTC')}",
    ]
    assert "acme" not in sql  # values never enter the SQL text
    assert parameters == {
        "tenant_id": "acme' OR 1=1 --",
        "since": "2026-01-02 03:04:05.678",
        "until": "2026-01-03 03:04:05.678",
    }


def test_tenant_totals_counts_requests_attempts_failures_and_tokens() -> None:
    sql, _ = TenantTotals().to_sql()

    for expression in (
        "uniqExact(request_id) AS num_requests",
        "count() AS num_attempts",
        "countIf(status = 'failed') AS num_failed",
        "sum(prompt_tokens) AS num_prompt_tokens",
        "sum(completion_tokens) AS num_completion_tokens",
        "sum(cached_tokens) AS num_cached_tokens",
    ):
        assert expression in sql


def test_session_totals_group_and_order_tenant_then_session() -> None:
    sql, parameters = SessionTotals(tenant_id="acme", session_id="sess_1", limit=50).to_sql()

    assert "FROM usage_events FINAL" in sql
    assert _clause(sql, "WHERE").split("\n  AND ") == [
        "tenant_id = {tenant_id:String}",
        "session_id = {session_id:String}",
    ]
    assert _clause(sql, "GROUP BY") == "tenant_id, session_id"
    assert _clause(sql, "ORDER BY") == "tenant_id, session_id"
    assert sql.endswith("LIMIT {limit:UInt64}")
    assert parameters == {"tenant_id": "acme", "session_id": "sess_1", "limit": 50}


def test_session_totals_without_limit_has_no_limit_clause() -> None:
    sql, parameters = SessionTotals(limit=None).to_sql()

    assert "LIMIT" not in sql
    assert "WHERE" not in sql
    assert parameters == {}


def test_bounds_are_converted_to_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    _, parameters = TenantTotals(since=datetime(2026, 5, 1, 2, 0, tzinfo=plus_two)).to_sql()

    assert parameters["since"] == "2026-05-01 00:00:00.000"


def test_naive_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        SessionTotals(since=datetime(2026, 5, 1)).to_sql()


def test_batch_totals_read_batch_lines_only_tenant_first() -> None:
    sql, parameters = BatchTotals().to_sql()

    assert "FROM usage_events FINAL" in sql
    assert _clause(sql, "WHERE") == "batch_id != ''"
    assert _clause(sql, "GROUP BY") == "tenant_id, batch_id"
    assert _clause(sql, "ORDER BY") == "tenant_id, batch_id"
    assert "sum(billed_units) AS billed_units" in sql
    assert parameters == {}


def test_batch_totals_of_one_batch_filter_through_parameters() -> None:
    sql, parameters = BatchTotals(tenant_id="acme", batch_id="b' OR 1=1 --").to_sql()

    assert _clause(sql, "WHERE") == (
        "tenant_id = {tenant_id:String}\n  AND batch_id = {batch_id:String}"
    )
    assert parameters == {"tenant_id": "acme", "batch_id": "b' OR 1=1 --"}
