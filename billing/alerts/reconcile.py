"""Reconciliation: the job's settled spend per budget and bucket against ClickHouse.

# job /budgets "buckets" (budget, bucket, [start, end), spent) --> one billed_units sum
# per bucket over usage_events (the budget's entity, the bucket's instants) --> drift

The job settles each request on the very ``billed_units`` the billing sink writes, in
the bucket of its admission (``created_at``), so for every bucket the two sums are equal
to the last digit; any difference is drift. Both read the usage topic, at their own
pace: a bucket still taking requests may differ for the seconds between the two, so a
bucket that drifts is read again after ``settle_s`` and reported only if it still does.

What a budget's entity sums: ``tenant:T`` its tenant's rows, ``key:H`` the rows whose
``key_sha256`` is H (migration 003), ``model:M`` every tenant's rows of M (exact with one
job instance: another holds other tenants' share), ``tenant_model:T/M`` both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from billing.reader import Reader

RECONCILE_SQL = """\
SELECT sum(billed_units) AS billed_units, count() AS num_attempts
FROM usage_events
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND ({model:String} = '' OR model = {model:String})
  AND ({key:String} = '' OR key_sha256 = {key:String})
  AND created_at >= {since:DateTime64(3, 'UTC')}
  AND created_at < {until:DateTime64(3, 'UTC')}"""


@dataclass(frozen=True)
class Drift:
    budget_id: str
    bucket: str
    job_units: Decimal
    billed_units: Decimal

    @property
    def drift_units(self) -> Decimal:
        """The job's spend less ClickHouse's: positive, the job counts more."""
        return self.job_units - self.billed_units

    def to_json(self) -> dict[str, str]:
        return {
            "budget_id": self.budget_id,
            "bucket": self.bucket,
            "job_units": str(self.job_units),
            "billed_units": str(self.billed_units),
            "drift_units": str(self.drift_units),
        }


def entity_filter(entity: str) -> dict[str, str]:
    """A budget's entity --> the tenant, model and key a billing query filters by."""
    scope, _, name = entity.partition(":")
    if scope == "tenant":
        return {"tenant": name, "model": "", "key": ""}
    if scope == "key":
        return {"tenant": "", "model": "", "key": name}
    if scope == "model":
        return {"tenant": "", "model": name, "key": ""}
    if scope == "tenant_model":
        tenant, _, model = name.partition("/")
        return {"tenant": tenant, "model": model, "key": ""}
    raise ValueError(f"no billing filter for entity {entity!r}")


def bucket_query(bucket: Mapping[str, Any]) -> dict[str, str]:
    """One row of the job's ``buckets`` --> the parameters of ``RECONCILE_SQL``."""
    entity = str(bucket["budget_id"]).partition("|")[0]
    return {
        **entity_filter(entity),
        "since": _clickhouse_time(str(bucket["start"])),
        "until": _clickhouse_time(str(bucket["end"])),
    }


def compare(reader: Reader, buckets: Sequence[Mapping[str, Any]]) -> list[Drift]:
    """Every bucket whose settled spend differs from ClickHouse's sum."""
    drifts = []
    for bucket in buckets:
        [row] = reader.query(RECONCILE_SQL, bucket_query(bucket))
        billed = Decimal(str(row["billed_units"] or 0))
        job = Decimal(str(bucket["spent"]))
        if job != billed:
            drifts.append(Drift(str(bucket["budget_id"]), str(bucket["bucket"]), job, billed))
    return drifts


def reconcile(
    read_buckets: Callable[[], Sequence[Mapping[str, Any]]],
    reader: Reader,
    *,
    settle_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[int, list[Drift]]:
    """(buckets compared, drift that lasted ``settle_s``)."""
    buckets = read_buckets()
    drifts = compare(reader, buckets)
    if drifts and settle_s > 0:
        sleep(settle_s)
        again = {(d.budget_id, d.bucket) for d in drifts}
        drifts = compare(
            reader, [b for b in read_buckets() if (b["budget_id"], b["bucket"]) in again]
        )
    return len(buckets), drifts


def _clickhouse_time(iso: str) -> str:
    """An ISO instant (UTC) --> ``YYYY-MM-DD hh:mm:ss.fff``, as DateTime64 parameters take."""
    return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
