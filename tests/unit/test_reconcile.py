"""Reconciliation: the job's buckets against billed_units in ClickHouse, to the digit."""

from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from click.testing import CliRunner

from billing.alerts.reconcile import Drift, bucket_query, entity_filter, reconcile
from billing.dedup import write_usage
from billing.reader import StoreReader
from billing.storage import ClickHouseStore
from schemas import UsageEvent, UsageStatus
from stream_jobs.budgets import Period, billed_nanos, to_units
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer

PRICER = Pricer(read_price_book(BUNDLED_PRICES))
KEY = "ab" * 32
MARCH = datetime(2026, 3, 10, 12, tzinfo=UTC)


def event(n: int, tenant: str, at: datetime, key: str | None = None) -> UsageEvent:
    return UsageEvent(
        request_id=f"r{n}",
        session_id="s",
        tenant_id=tenant,
        model="m",
        status=UsageStatus.OK,
        num_prompt_tokens=6,
        num_completion_tokens=n,
        key_sha256=key,
        created_at=at,
    )


def bucket(budget_id: str, events: Sequence[UsageEvent], **extra: str) -> dict[str, str]:
    period = Period.parse(budget_id.split("|")[1].split("@")[0])
    name = period.bucket_of(MARCH)
    start, end = period.bounds(name)
    spent = sum(billed_nanos(PRICER, e) for e in events)
    return {
        "budget_id": budget_id,
        "bucket": name,
        "start": start.isoformat(),
        "end": end.isoformat(),
        "spent": str(to_units(spent)),
        **extra,
    }


@pytest.fixture
def reader() -> Iterator[StoreReader]:
    with ClickHouseStore("chdb://memory") as store:
        yield StoreReader(store)


def test_each_entity_filters_what_its_budget_charges() -> None:
    assert entity_filter("tenant:acme") == {"tenant": "acme", "model": "", "key": ""}
    assert entity_filter(f"key:{KEY}") == {"tenant": "", "model": "", "key": KEY}
    assert entity_filter("model:m") == {"tenant": "", "model": "m", "key": ""}
    assert entity_filter("tenant_model:acme/a/b") == {"tenant": "acme", "model": "a/b", "key": ""}
    row = {"budget_id": "tenant:acme|day@UTC", "start": "2026-03-10T00:00:00+00:00"}
    query = bucket_query({**row, "end": "2026-03-11T00:00:00+00:00"})
    assert (query["since"], query["until"]) == (
        "2026-03-10 00:00:00.000",
        "2026-03-11 00:00:00.000",
    )


def test_equal_sums_are_no_drift_and_a_missing_row_is(reader: StoreReader) -> None:
    keyed = [event(1, "acme", MARCH, KEY), event(2, "acme", MARCH, KEY)]
    other = [event(3, "acme", MARCH), event(4, "beta", MARCH)]
    april = [event(5, "acme", datetime(2026, 4, 1, tzinfo=UTC), KEY)]
    write_usage(reader._store, [*keyed, *other, *april], PRICER)
    buckets = [
        bucket("tenant:acme|month@UTC", [*keyed, other[0]]),
        bucket(f"key:{KEY}|month@UTC", keyed),
        bucket(f"key:{KEY}|total", [*keyed, *april]),  # a token's balance: all its life
        bucket("model:m|day@UTC", [*keyed, *other]),
        bucket("tenant_model:beta/m|month@UTC", other[1:]),
    ]
    assert reconcile(lambda: buckets, reader, settle_s=0) == (5, [])

    short = bucket("tenant:acme|month@UTC", keyed)  # the job missed one row
    _, drifts = reconcile(lambda: [short], reader, settle_s=0)
    (drift,) = drifts
    assert drift.drift_units == -to_units(billed_nanos(PRICER, other[0])) < 0


def test_drift_is_reported_only_if_it_lasts(reader: StoreReader) -> None:
    rows = [event(1, "acme", MARCH)]
    late = bucket("tenant:acme|month@UTC", rows)  # the job settled it; billing not yet
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        write_usage(reader._store, rows, PRICER)  # the sink catches up meanwhile

    assert reconcile(lambda: [late], reader, settle_s=3, sleep=sleep) == (1, [])
    assert waits == [3]


def test_the_command_prints_drift_and_exits_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenbus import budget_admin
    from tokenbus_cli import cli

    buckets = [
        {"budget_id": "tenant:acme|day@UTC", "bucket": "2026-03-10", "spent": "1"},
        {"budget_id": "tenant:beta|day@UTC", "bucket": "2026-03-09", "spent": "2"},
    ]
    seen: list[list[str]] = []

    def fake_reconcile(read: Any, reader: Any, *, settle_s: float) -> tuple[int, list[Drift]]:
        rows: list[Mapping[str, Any]] = list(read())
        seen.append([str(r["bucket"]) for r in rows])
        drift = Drift("tenant:acme|day@UTC", "2026-03-10", Decimal("1"), Decimal("0.5"))
        return len(rows), [drift]

    class Reader:
        def close(self) -> None:
            pass

    monkeypatch.setattr(budget_admin, "job_budgets", lambda settings: {"buckets": buckets})
    monkeypatch.setattr("billing.reader.open_reader", lambda settings: Reader())
    monkeypatch.setattr("billing.alerts.reconcile.reconcile", fake_reconcile)
    result = CliRunner().invoke(cli.main, ["budget", "reconcile", "--period", "2026-03-10"])
    assert result.exit_code == 1
    assert seen == [["2026-03-10"]]
    assert "drift tenant:acme|day@UTC 2026-03-10: job 1, ClickHouse 0.5 (+0.5)" in result.output
    assert "1 buckets compared, 1 drifting" in result.output
