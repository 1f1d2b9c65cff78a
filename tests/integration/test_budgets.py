"""Spend budgets on the real stack (issue 23): the session's stack, whose tenants file
holds the ``bud-*`` tenants' budgets (``conftest._budget_tenants``), whose job's clock
the test moves (``<home>/clock-offset``), and whose alerts go to a local webhook
receiver (``conftest.webhook``).

Prices: tiny-llama, 0.0001 in and 0.0003 out per 1k tokens. Prompt "x" is 2 tokens, so
a request with max_tokens 22 reserves 2 x 100 + 22 x 300 = 6,800 nano-units, and with
ignore_eos it is billed at most that (less if its prompt was cached).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from decimal import Decimal

import httpx
import jwt

from billing.alerts.reconcile import reconcile
from billing.alerts.webhook import verify
from billing.reader import open_reader
from producers import TokenbusClient
from schemas import SamplingParams
from tests.integration.conftest import (
    BUDGET_HARD_KEY,
    BUDGET_TEAM_KEY,
    BUS_JWT_SECRET,
    WEBHOOK_SECRET,
    WebhookReceiver,
    eventually,
)
from tokenbus.budget_admin import job_budgets
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus_cli.stack import Stack, settings_env

SHORT = SamplingParams(max_tokens=22, ignore_eos=True)
RESERVED = Decimal("0.0000068")


async def ask(client: TokenbusClient, tenant: str) -> Chunk:
    request = await client.submit(tenant_id=tenant, prompt="x", sampling=SHORT)
    return [chunk async for chunk in client.stream(request)][-1]


def billed(settings: Settings, tenant: str) -> tuple[int, Decimal]:
    (row,) = open_reader(settings).query(
        "SELECT count() AS n, sum(billed_units) AS billed FROM usage_events FINAL"
        " WHERE tenant_id = {tenant:String}",
        {"tenant": tenant},
    )
    return int(row["n"]), Decimal(str(row["billed"]))


def job_spend(settings: Settings, budget_id: str) -> tuple[Decimal, Decimal]:
    rows = [b for b in job_budgets(settings)["budgets"] if b["budget_id"] == budget_id]
    return (Decimal(rows[0]["spent"]), Decimal(rows[0]["reserved"])) if rows else (Decimal(0),) * 2


async def until_billed(settings: Settings, tenant: str, num_rows: int) -> Decimal:
    _, total = await eventually(
        lambda: billed(settings, tenant), until=lambda r: r[0] >= num_rows, timeout_s=60
    )
    return total


async def test_a_hard_budget_refuses_before_it_is_crossed_and_clickhouse_agrees(
    stack: Stack, client: TokenbusClient
) -> None:
    settings = stack.settings
    num_sent = 0
    for _ in range(20):
        last = await ask(client, "bud-hard")
        num_sent += 1
        if last.error is not None:
            break
    assert last.error is not None and last.error.code == "insufficient_quota", last
    admitted = num_sent - 1
    assert admitted == 7  # 7 x 6,800 = 47,600 <= 50,000 < 8 x 6,800
    total = await until_billed(settings, "bud-hard", num_sent)
    assert total <= Decimal("0.00005")
    spent, reserved = job_spend(settings, "tenant:bud-hard|month@UTC")
    assert (spent, reserved) == (total, Decimal(0))  # exactly ClickHouse's sum
    # The bridge answers the same refusal in OpenAI's shape.
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            f"http://127.0.0.1:{settings.bridge_port}/v1/completions",
            headers={"Authorization": f"Bearer {BUDGET_HARD_KEY}"},
            json={"model": "tiny-llama", "prompt": "x", "max_tokens": 22},
        )
        metrics = (await http.get(f"http://127.0.0.1:{settings.faust_web_port}/metrics")).text
    assert answer.status_code == 429
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert 'tokenbus_job_budget_remaining_units{budget="tenant:bud-hard|month@UTC"' in metrics


async def test_a_key_s_budget_binds_inside_its_team_s(stack: Stack, client: TokenbusClient) -> None:
    # The case LiteLLM gets wrong: the key under a team-like tenant has its own budget.
    settings = stack.settings
    async with TokenbusClient(settings, tenant_id="bud-team", credential=BUDGET_TEAM_KEY) as by_key:
        assert (await ask(by_key, "bud-team")).error is None
        assert (await ask(by_key, "bud-team")).error is None
        refused = await ask(by_key, "bud-team")  # 3 x 6,800 > the key's 20,000
    assert refused.error is not None and refused.error.code == "insufficient_quota"
    assert "key:" in refused.error.message
    # The tenant's other credentials still spend the rest of the tenant's 50,000.
    assert (await ask(client, "bud-team")).error is None


async def test_soft_alerts_reach_the_webhook_once_each_across_a_job_sigkill(
    stack: Stack, client: TokenbusClient
) -> None:
    settings = stack.settings
    WebhookReceiver.received.clear()

    def soft_thresholds() -> list[int]:
        found = []
        for headers, body in WebhookReceiver.received:
            alert = json.loads(body)
            if alert["budget_id"] == "tenant:bud-soft|month@UTC":
                assert verify(
                    WEBHOOK_SECRET,
                    headers["X-Tokenbus-Timestamp"],
                    body,
                    headers["X-Tokenbus-Signature"],
                )
                found.append(alert["threshold"])
        return found

    for _ in range(2):  # 2 x 6,800 of 20,000: 68%
        assert (await ask(client, "bud-soft")).error is None
    assert await eventually(soft_thresholds, until=lambda t: t == [50]) == [50]
    await until_billed(settings, "bud-soft", 2)
    await stack.restart("stream_job")  # SIGKILL mid-period, between thresholds
    spent, reserved = job_spend(settings, "tenant:bud-soft|month@UTC")
    assert (spent, reserved) == (billed(settings, "bud-soft")[1], Decimal(0))  # no double, no loss
    assert (await ask(client, "bud-soft")).error is None  # 102%: soft, still admitted
    fired = await eventually(soft_thresholds, until=lambda t: len(t) >= 4, timeout_s=30)
    await asyncio.sleep(2)  # nothing more comes
    assert soft_thresholds() == fired == [50, 80, 95, 100]
    total = await until_billed(settings, "bud-soft", 3)
    assert job_spend(settings, "tenant:bud-soft|month@UTC") == (total, Decimal(0))


async def test_moving_the_clock_into_the_next_period_admits_again(
    stack: Stack, client: TokenbusClient
) -> None:
    settings = stack.settings
    assert (await ask(client, "bud-day")).error is None
    refused = await ask(client, "bud-day")
    assert refused.error is not None and refused.error.code == "insufficient_quota"
    assert refused.error.retry_after_s is not None
    assert settings.clock_offset_file is not None
    settings.clock_offset_file.write_text(str(refused.error.retry_after_s + 1))
    try:
        assert (await ask(client, "bud-day")).error is None
    finally:
        settings.clock_offset_file.write_text("0")


async def test_a_token_s_balance_binds_before_its_tenant_s_budget(
    stack: Stack, client: TokenbusClient
) -> None:
    settings = stack.settings
    claims = {"tenant": "bud-token", "aud": "tokenbus", "exp": int(time.time()) + 600}
    token = jwt.encode({**claims, "quota_balance": "0.00001"}, BUS_JWT_SECRET, algorithm="HS256")
    budget_id = f"key:{hashlib.sha256(token.encode()).hexdigest()}|total"
    async with TokenbusClient(settings, tenant_id="bud-token", credential=token) as by_token:
        assert (await ask(by_token, "bud-token")).error is None  # 6,800 of its 10,000
        refused = await ask(by_token, "bud-token")  # the tenant has 43,200 left
    assert refused.error is not None and refused.error.code == "insufficient_quota"
    assert budget_id in refused.error.message
    assert (await ask(client, "bud-token")).error is None  # the tenant's other credentials
    await until_billed(settings, "bud-token", 2)


async def test_alerts_land_in_clickhouse_and_the_job_reconciles_with_it(
    stack: Stack,
) -> None:
    # After the tests above: every budget and bucket they spent in, alerts included.
    settings = stack.settings

    def soft_alerts() -> list[int]:
        rows = open_reader(settings).query(
            "SELECT threshold FROM budget_alerts WHERE tenant_id = 'bud-soft' ORDER BY threshold"
        )
        return [int(r["threshold"]) for r in rows]

    assert await eventually(soft_alerts, until=lambda t: len(t) >= 4) == [50, 80, 95, 100]
    url = f"http://127.0.0.1:{settings.billing_query_port}/dashboard"
    page = (await asyncio.to_thread(httpx.get, url)).text
    assert "tenant:bud-soft|month@UTC" in page
    buckets = job_budgets(settings)["buckets"]
    num_buckets, drifts = reconcile(lambda: buckets, open_reader(settings), settle_s=5)
    assert drifts == [] and num_buckets >= 6
    assert any(b["budget_id"].endswith("|total") for b in buckets)  # the token's balance
    assert any(b["budget_id"].startswith("key:") and "@" in b["budget_id"] for b in buckets)
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tokenbus_cli.cli", "budget", "reconcile"],
        env=settings_env(settings),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    assert b"0 drifting" in done.stdout
