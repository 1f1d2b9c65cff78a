"""The dashboard page from query rows: totals, charts, escaping, errors."""

from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

from billing.html import render_dashboard

NOW = datetime(2026, 3, 2, 12, tzinfo=UTC)
FILTERS = {"tenant": "", "since": "2026-03-01 00:00:00", "until": "2026-03-03 00:00:00"}


def _results() -> dict[str, list[dict[str, Any]]]:
    spend = [
        {
            "tenant_id": tenant,
            "day": date(2026, 3, 1),
            "billed_units": Decimal(billed),
            "cost_units": Decimal(billed) * 2,
            "num_attempts": 10,
            "prompt_tokens": 1000,
            "completion_tokens": 50,
        }
        for tenant, billed in (("acme", "1.5"), ("beta", "0.25"))
    ]
    share = [
        {
            "tenant": tenant,
            "total_attempts": 10,
            "failed_attempts": 1,
            "cancelled_attempts": 1,
            "cost_share": share,
        }
        for tenant, share in (("acme", 0.1), ("*", 0.125))
    ]
    return {"spend_by_tenant_per_day": spend, "failed_cancelled_share": share}


def test_totals_sum_the_spend_rows_and_show_the_overall_share() -> None:
    page = render_dashboard(_results(), FILTERS, generated_at=NOW)

    assert "<b>1.7500</b><span>billed cost units</span>" in page
    assert "<b>3.5000</b><span>cost at list price</span>" in page
    assert "<b>20</b><span>request attempts</span>" in page
    assert "<b>2,100</b><span>tokens</span>" in page
    assert "<b>12.5%</b>" in page
    assert "as of 2026-03-02 12:00:00 UTC" in page


def test_rows_that_crossed_json_render_the_same() -> None:
    results = _results()
    for row in results["spend_by_tenant_per_day"]:
        row["billed_units"] = str(row["billed_units"])
        row["cost_units"] = str(row["cost_units"])
        row["day"] = "2026-03-01"

    page = render_dashboard(results, FILTERS, generated_at=NOW)

    assert "<b>1.7500</b><span>billed cost units</span>" in page


def test_the_form_keeps_the_filters_and_escapes_them() -> None:
    page = render_dashboard({}, {**FILTERS, "tenant": '"><script>'}, generated_at=NOW)

    assert 'value="2026-03-01 00:00:00"' in page
    assert "<script>" not in page
    assert "&quot;&gt;&lt;script&gt;" in page


def test_a_failed_query_shows_its_error_in_its_card_only() -> None:
    page = render_dashboard(
        _results(), FILTERS, generated_at=NOW, errors={"top_sessions_by_cost": "Code: 62 <bad>"}
    )

    assert '<p class="error">Code: 62 &lt;bad&gt;</p>' in page
    assert page.count('class="error"') == 1


def test_the_page_is_self_contained() -> None:
    page = render_dashboard(_results(), FILTERS, generated_at=NOW)

    assert "<script" not in page
    assert "<link" not in page
    assert page.startswith("<!doctype html>")


def test_context_buckets_are_labelled_in_k_tokens() -> None:
    rows = [
        {
            "context_from": start,
            "context_to": start + 2048,
            "num_attempts": 1,
            "tokens": 10,
            "cost_per_1k_tokens": 0.5,
            "mean_cost_weight": 1.2,
        }
        for start in (0, 2048, 14336)
    ]

    page = render_dashboard({"cost_per_1k_by_context_bucket": rows}, FILTERS, generated_at=NOW)

    for label in ("0-2k", "2k-4k", "14k-16k"):
        assert f">{label}</text>" in page


def test_recent_budget_alerts_are_a_table_per_tenant_and_escaped() -> None:
    rows = [
        {
            "tenant_id": "acme",
            "fired_at": datetime(2026, 3, 2, 11, 59, 30, tzinfo=UTC),
            "budget_id": "tenant:acme|month@UTC",
            "entity": "tenant:acme",
            "threshold": 80,
            "reason": "threshold",
            "enforce": "hard",
            "spent_units": "1.600000000",  # as it crossed the query server's JSON
            "limit_units": "2.000000000",
            "period_start": "2026-03-01T00:00:00+00:00",
            "period_end": "2026-04-01T00:00:00+00:00",
        },
        {
            "tenant_id": "<beta>",
            "fired_at": "2026-03-02T10:00:00+00:00",
            "budget_id": "model:m|day@UTC",
            "entity": "model:m",
            "threshold": 100,
            "reason": "refused",
            "enforce": "hard",
            "spent_units": Decimal("5.000000000"),
            "limit_units": Decimal("5.000000000"),
            "period_start": "2026-03-02T00:00:00+00:00",
            "period_end": "2026-03-03T00:00:00+00:00",
        },
    ]
    page = render_dashboard({"recent_budget_alerts": rows}, FILTERS, generated_at=NOW)

    assert "Recent budget alerts" in page
    assert "<td>tenant:acme|month@UTC</td><td>80%</td><td>threshold</td>" in page
    assert "<td>1.600000000 / 2.000000000</td>" in page  # to the last digit
    assert "<td>2026-03-02 11:59:30</td>" in page and "<td>2026-03-02 10:00:00</td>" in page
    assert "&lt;beta&gt;" in page and "<beta>" not in page
    empty = render_dashboard({}, FILTERS, generated_at=NOW)
    assert "no budget alerts in this window" in empty


def test_spend_per_batch_is_a_chart_and_table_of_each_batch_escaped() -> None:
    rows = [
        {
            "tenant_id": "acme",
            "batch_id": "batch_<01>",
            "billed_units": Decimal("0.25"),
            "cost_units": Decimal("0.25"),
            "num_attempts": 500,
            "num_failed": 2,
            "prompt_tokens": 12_000,
            "completion_tokens": 3_000,
        }
    ]

    page = render_dashboard({"spend_per_batch": rows}, FILTERS, generated_at=NOW)
    empty = render_dashboard({}, FILTERS, generated_at=NOW)

    assert "Spend per batch" in page
    assert "acme / batch_&lt;01&gt;" in page and "batch_<01>" not in page
    assert "<td>500</td>" in page and "<td>12,000</td>" in page
    assert "no batch lines in this window" in empty
