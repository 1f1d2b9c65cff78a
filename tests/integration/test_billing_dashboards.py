"""Every dashboard query against seeded data, and the HTML dashboard in headless Chromium.

The expected rows are computed here in Python from the seeded UsageEvents, not taken
from a query's output. The queries that read the rollups must be answered by them
(``force_optimize_projection``). The page is served by the billing query server and
rendered by Debian's Chromium (``make chromium``), which saves a screenshot.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import statistics
import struct
import tempfile
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from billing.dedup import write_usage
from billing.queries import dashboard_query
from billing.query_server import create_app, start_query_server
from billing.storage import ClickHouseStore
from schemas import UsageEvent, UsageStatus
from tokenbus.cost import PeakHours
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer
from tokenbus_cli.stack import REPO_ROOT, free_port

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = REPO_ROOT / ".tokenbus" / "screenshots" / "billing-dashboard.png"
PRICER = Pricer(read_price_book(BUNDLED_PRICES), PeakHours.parse("9-17"))
T0 = datetime(2026, 3, 1, 6, 0, tzinfo=UTC)
TENANTS = ("acme", "globex", "initech")
SINCE = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
UNTIL = datetime(2026, 3, 2, 18, 0, tzinfo=UTC)
WINDOW = {"since": "2026-03-01 12:00:00", "until": "2026-03-02 18:00:00"}
ROLLUP_QUERIES = (
    "spend_by_tenant_per_day",
    "tokens_per_minute_by_tenant",
    "top_sessions_by_cost",
    "failed_cancelled_share",
)


def _seed() -> list[UsageEvent]:
    rng = random.Random(11)
    statuses = [UsageStatus.OK] * 12 + [
        UsageStatus.FAILED,
        UsageStatus.CANCELLED,
        UsageStatus.REJECTED,
    ]
    events = []
    for n in range(900):
        status = rng.choice(statuses)
        ran = status is not UsageStatus.REJECTED
        prompt = rng.choice([rng.randint(20, 600), rng.randint(2048, 15000)])
        # Two and a half days, some of it outside the window on either side; the last six
        # sessions end before the window opens.
        hours = 5 if n % 60 >= 54 else 60
        created = T0 + timedelta(seconds=rng.randint(0, hours * 60 * 60))
        events.append(
            UsageEvent(
                request_id=f"req_{n}",
                session_id=f"sess_{n % 60}",
                tenant_id=TENANTS[n % 60 % 3],  # a session belongs to one tenant
                model=rng.choice(["tiny-llama", "big-model"]),
                priority=rng.randint(0, 2),
                status=status,
                num_prompt_tokens=prompt if ran else 0,
                num_completion_tokens=rng.randint(1, 300) if ran else 0,
                num_cached_tokens=rng.choice([0, 0, 64]) if ran else 0,
                ttft_ms=round(rng.uniform(3, 500), 3) if ran else None,
                precision=rng.choice(["fp16", "int8"]),
                created_at=created,
                finished_at=created + timedelta(seconds=rng.randint(1, 300)),
            )
        )
        if events[-1].priority == 2 and n % 5 == 0:  # a line of one of four batch jobs
            events[-1] = events[-1].model_copy(update={"batch_id": f"batch_{n % 4}"})
    return events


@pytest.fixture(scope="module")
def events() -> list[UsageEvent]:
    return _seed()


@pytest.fixture(scope="module")
def store(
    events: list[UsageEvent], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClickHouseStore]:
    directory = tmp_path_factory.mktemp("dashboards") / "clickhouse"
    with ClickHouseStore(f"chdb://{directory}") as store:
        # Twice, as after a redelivery: the second write must add nothing.
        write_usage(store, events, PRICER)
        write_usage(store, events[::7], PRICER)
        yield store


def _minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


def _in_window(at: datetime) -> bool:
    return SINCE <= at < UNTIL


def _run(store: ClickHouseStore, name: str, params: dict[str, str]) -> list[dict[str, Any]]:
    sql, values = dashboard_query(name).to_sql(params)
    rows = store.query(sql, values)
    if name in ROLLUP_QUERIES:  # must be answered by the rollups, not by a scan
        assert store.query(sql + "\nSETTINGS force_optimize_projection = 1", values) == rows
    return rows


def _approx(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: pytest.approx(v, rel=1e-9) if isinstance(v, float) else v for k, v in row.items()}
        for row in rows
    ]


def _sums(events: list[UsageEvent]) -> dict[str, Any]:
    charges = [PRICER.charge(e) for e in events]
    return {
        "billed_units": sum((c.billed_units for c in charges), Decimal(0)),
        "cost_units": sum((c.cost_units for c in charges), Decimal(0)),
        "num_attempts": len(events),
        "prompt_tokens": sum(e.num_prompt_tokens for e in events),
        "completion_tokens": sum(e.num_completion_tokens for e in events),
    }


def _grouped(events: list[UsageEvent], key: Any) -> dict[Any, list[UsageEvent]]:
    groups: dict[Any, list[UsageEvent]] = defaultdict(list)
    for event in events:
        groups[key(event)].append(event)
    return dict(sorted(groups.items()))


def test_spend_by_tenant_per_day(store: ClickHouseStore, events: list[UsageEvent]) -> None:
    mine = [e for e in events if _in_window(_minute(e.created_at))]
    expected = [
        {"tenant_id": tenant, "day": day, **_sums(group)}
        for (tenant, day), group in _grouped(
            mine, lambda e: (e.tenant_id, e.created_at.date())
        ).items()
    ]

    assert _run(store, "spend_by_tenant_per_day", WINDOW) == expected
    assert len({row["day"] for row in expected}) == 2  # the window spans two days
    only_globex = _run(store, "spend_by_tenant_per_day", {**WINDOW, "tenant": "globex"})
    assert only_globex == [row for row in expected if row["tenant_id"] == "globex"]


def test_tokens_per_minute_by_tenant(store: ClickHouseStore, events: list[UsageEvent]) -> None:
    mine = [e for e in events if e.tenant_id == "acme" and _in_window(_minute(e.created_at))]
    expected = []
    for (tenant, minute), group in _grouped(
        mine, lambda e: (e.tenant_id, _minute(e.created_at))
    ).items():
        prompt = sum(e.num_prompt_tokens for e in group)
        completion = sum(e.num_completion_tokens for e in group)
        expected.append(
            {
                "tenant_id": tenant,
                "minute": minute,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        )

    assert _run(store, "tokens_per_minute_by_tenant", {**WINDOW, "tenant": "acme"}) == expected


def test_top_sessions_by_cost(store: ClickHouseStore, events: list[UsageEvent]) -> None:
    sessions = []
    for (tenant, session), group in _grouped(events, lambda e: (e.tenant_id, e.session_id)).items():
        first = min(e.created_at for e in group)
        last = max(e.finished_at for e in group)
        if first < UNTIL and last >= SINCE:
            sums = _sums(group)
            sessions.append(
                {
                    "tenant_id": tenant,
                    "session_id": session,
                    "billed_units": sums["billed_units"],
                    "cost_units": sums["cost_units"],
                    "num_attempts": sums["num_attempts"],
                    "num_failed": sum(e.status is UsageStatus.FAILED for e in group),
                    "prompt_tokens": sums["prompt_tokens"],
                    "completion_tokens": sums["completion_tokens"],
                    "first_created_at": first,
                    "last_finished_at": last,
                }
            )
    sessions.sort(key=lambda r: (-r["billed_units"], r["tenant_id"], r["session_id"]))

    assert _run(store, "top_sessions_by_cost", {**WINDOW, "limit": "7"}) == sessions[:7]
    assert _run(store, "top_sessions_by_cost", {**WINDOW, "limit": "1000"}) == sessions
    assert len(sessions) == 54  # six sessions ended before the window


def test_spend_per_batch(store: ClickHouseStore, events: list[UsageEvent]) -> None:
    lines = [e for e in events if e.batch_id is not None and _in_window(e.created_at)]
    batches = []
    for (tenant, batch), group in _grouped(lines, lambda e: (e.tenant_id, e.batch_id)).items():
        sums = _sums(group)
        batches.append(
            {
                "tenant_id": tenant,
                "batch_id": batch,
                "billed_units": sums["billed_units"],
                "cost_units": sums["cost_units"],
                "num_attempts": sums["num_attempts"],
                "num_failed": sum(e.status is UsageStatus.FAILED for e in group),
                "prompt_tokens": sums["prompt_tokens"],
                "completion_tokens": sums["completion_tokens"],
                "first_created_at": min(e.created_at for e in group),
                "last_finished_at": max(e.finished_at for e in group),
            }
        )
    batches.sort(key=lambda r: (-r["billed_units"], r["tenant_id"], r["batch_id"]))

    assert _run(store, "spend_per_batch", WINDOW) == batches
    assert _run(store, "spend_per_batch", {**WINDOW, "limit": "3"}) == batches[:3]
    only_acme = _run(store, "spend_per_batch", {**WINDOW, "tenant": "acme"})
    assert only_acme == [row for row in batches if row["tenant_id"] == "acme"]
    assert len(batches) == 11  # of 3 tenants x 4 batch ids, one pair has no line in the window
    # Priced as batch lines: half what the same work costs outside a batch (each line
    # rounded to the column's nine decimals once).
    full = _sums([e.model_copy(update={"batch_id": None}) for e in lines])["cost_units"]
    halved = sum((r["cost_units"] for r in batches), Decimal(0))
    assert abs(2 * halved - full) <= len(lines) * Decimal("0.000000001")


def test_share_of_failed_and_cancelled_work(
    store: ClickHouseStore, events: list[UsageEvent]
) -> None:
    mine = [e for e in events if _in_window(_minute(e.created_at))]

    def share(tenant: str, group: list[UsageEvent]) -> dict[str, Any]:
        costs = {e.request_id: PRICER.charge(e).cost_units for e in group}

        def cost(*statuses: UsageStatus) -> Decimal:
            return sum((costs[e.request_id] for e in group if e.status in statuses), Decimal(0))

        tokens = {e.request_id: e.num_prompt_tokens + e.num_completion_tokens for e in group}
        wasted = [e for e in group if e.status in (UsageStatus.FAILED, UsageStatus.CANCELLED)]
        total_cost = sum(costs.values(), Decimal(0))
        failed, cancelled = cost(UsageStatus.FAILED), cost(UsageStatus.CANCELLED)
        return {
            "tenant": tenant,
            "total_attempts": len(group),
            "failed_attempts": sum(e.status is UsageStatus.FAILED for e in group),
            "cancelled_attempts": sum(e.status is UsageStatus.CANCELLED for e in group),
            "total_cost_units": total_cost,
            "failed_cost_units": failed,
            "cancelled_cost_units": cancelled,
            "cost_share": float(failed + cancelled) / float(total_cost),
            "total_tokens": sum(tokens.values()),
            "failed_cancelled_tokens": sum(tokens[e.request_id] for e in wasted),
            "token_share": sum(tokens[e.request_id] for e in wasted) / sum(tokens.values()),
        }

    expected = [share(t, g) for t, g in _grouped(mine, lambda e: e.tenant_id).items()]
    expected.append(share("*", mine))

    rows = _run(store, "failed_cancelled_share", WINDOW)
    assert rows == _approx(expected)
    assert 0.05 < rows[-1]["cost_share"] < 0.5  # the seeded failures show


def _buckets(events: list[UsageEvent], width: int) -> list[dict[str, Any]]:
    rows = []
    for start, group in _grouped(events, lambda e: e.num_prompt_tokens // width * width).items():
        tokens = sum(e.num_prompt_tokens + e.num_completion_tokens for e in group)
        cost = sum((PRICER.charge(e).cost_units for e in group), Decimal(0))
        rows.append(
            {
                "context_from": start,
                "context_to": start + width,
                "num_attempts": len(group),
                "tokens": tokens,
                "cost_units": cost,
                "cost_per_1k_tokens": float(cost) * 1000 / tokens,
                "mean_cost_weight": statistics.fmean(PRICER.charge(e).cost_weight for e in group),
            }
        )
    return rows


def test_cost_per_1k_tokens_by_context_bucket(
    store: ClickHouseStore, events: list[UsageEvent]
) -> None:
    ran = [e for e in events if _in_window(e.created_at) and e.status is not UsageStatus.REJECTED]
    expected = _buckets(ran, 2048)

    assert _run(store, "cost_per_1k_by_context_bucket", WINDOW) == _approx(expected)
    assert len(expected) >= 6  # short prompts and long ones up to 15k tokens
    # Long context costs more per token: the weight grows with every 2k.
    assert expected[-1]["mean_cost_weight"] > expected[1]["mean_cost_weight"] > 1.0
    acme = [e for e in ran if e.tenant_id == "acme"]
    rows = _run(
        store,
        "cost_per_1k_by_context_bucket",
        {**WINDOW, "tenant": "acme", "bucket_tokens": "4096"},
    )
    assert rows == _approx(_buckets(acme, 4096))


def test_p50_and_p99_ttft_by_tenant_and_priority(
    store: ClickHouseStore, events: list[UsageEvent]
) -> None:
    timed = [e for e in events if e.ttft_ms is not None and _in_window(e.created_at)]
    expected = []
    for (tenant, priority), group in _grouped(timed, lambda e: (e.tenant_id, e.priority)).items():
        values = sorted(e.ttft_ms for e in group if e.ttft_ms is not None)
        # Exact quantiles interpolated between ranks: Python's "inclusive" method.
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        expected.append(
            {
                "tenant_id": tenant,
                "priority": priority,
                "num_attempts": len(values),
                "p50_ttft_ms": cuts[49],
                "p99_ttft_ms": cuts[98],
            }
        )

    assert _run(store, "ttft_by_tenant_and_priority", WINDOW) == _approx(expected)
    assert len(expected) == 9  # three tenants x three priority classes


@pytest.fixture
async def dashboard_url(store: ClickHouseStore) -> AsyncIterator[str]:
    port = free_port()
    runner = await start_query_server(create_app(store, dsn=store.dsn), port)
    try:
        yield f"http://127.0.0.1:{port}/dashboard?" + urllib.parse.urlencode(WINDOW)
    finally:
        await runner.cleanup()


async def test_the_html_dashboard_renders_in_headless_chromium(dashboard_url: str) -> None:
    await asyncio.to_thread(_fresh_screenshot_path)
    profile = Path(tempfile.mkdtemp(prefix="chromium-"))
    try:
        process = await asyncio.create_subprocess_exec(
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--screenshot={SCREENSHOT}",
            "--window-size=1400,2000",
            dashboard_url,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
        except TimeoutError:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            raise
    finally:
        shutil.rmtree(profile, ignore_errors=True)

    assert process.returncode == 0, stderr.decode(errors="replace")[-2000:]
    png = await asyncio.to_thread(SCREENSHOT.read_bytes)
    print(f"screenshot: {SCREENSHOT} ({len(png):,} bytes)")
    assert _png_size(png) == (1400, 2000)
    # A blank page, or Chromium's "can't reach" page, compresses to a few tens of kB;
    # six cards of charts and tables do not.
    assert len(png) > 100_000
    # What Chromium was shown: every card, drawn, and no query failed.
    page = await asyncio.to_thread(_get, dashboard_url)
    assert page.count("<svg") >= 6
    assert 'class="error"' not in page
    for tenant in TENANTS:
        assert tenant in page


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _fresh_screenshot_path() -> None:
    assert CHROMIUM.exists(), "no /usr/bin/chromium: run `make chromium` (Debian package)"
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
