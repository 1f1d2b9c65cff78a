"""Spend budgets on the real stack (issue 23): a stack of its own, with budgets in its
tenants file, a clock the test moves, and a local webhook receiver.

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
import threading
import time
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest

from alerts.reconcile import reconcile
from alerts.webhook import verify
from billing.reader import open_reader
from producers import TokenbusClient
from schemas import SamplingParams, TokenChunk
from tests.integration.conftest import eventually, free_port
from tokenbus.budget_admin import job_budgets
from tokenbus.config import Settings
from tokenbus.tenants import hash_api_key
from tokenbus_cli.stack import Stack, settings_env

SHORT = SamplingParams(max_tokens=22, ignore_eos=True)
RESERVED = Decimal("0.0000068")
WEBHOOK_SECRET = "webhook-secret-0123456789"
TEAM_KEY = "sk-bud-team-0123456789abcdef"
HARD_KEY = "sk-bud-hard-0123456789abcdef"
TENANTS = {
    "bud-hard": {
        "api_key_sha256": [hash_api_key(HARD_KEY)],
        "budgets": [{"limit": "0.00005", "period": "month"}],  # 7 reservations fit
    },
    "bud-team": {
        "api_key_sha256": [hash_api_key(TEAM_KEY)],
        "budgets": [
            {"limit": "0.00005", "period": "month"},
            {"key_sha256": hash_api_key(TEAM_KEY), "limit": "0.00002", "period": "month"},
        ],
    },
    "bud-soft": {"budgets": [{"limit": "0.00002", "enforce": "soft"}]},
    "bud-day": {"budgets": [{"limit": "0.00001", "period": "day"}]},  # one a day
    "bud-token": {"budgets": [{"limit": "0.00005", "period": "month"}]},
}
JWT_SECRET = "bud-jwt-hs256-secret-0123456789abcdef"


class Receiver(BaseHTTPRequestHandler):
    received: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Receiver.received.append((dict(self.headers), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def webhook() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()


@pytest.fixture(scope="module")
def budget_stack(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, webhook: str
) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("tokenbus-budgets")
    tenants_file = home / "tenants.json"
    tenants_file.write_text(json.dumps({"tenants": TENANTS}))
    (home / "clock-offset").write_text("0")
    settings = Settings(
        home=home,
        kafka_port=free_port(),
        billing_query_port=free_port(),
        faust_web_port=free_port(),
        bridge_port=free_port(),
        alerts_port=free_port(),
        batch_port=free_port(),
        model_path=model_dir,
        tenants_file=tenants_file,
        client_timeout_s=60,
        allow_unlisted_tenants=True,
        clock_offset_file=home / "clock-offset",
        budget_webhook_url=webhook,
        budget_webhook_secret=WEBHOOK_SECRET,
        jwt_hs256_secret=JWT_SECRET,
    )
    stack = Stack(settings, on_progress=print)
    asyncio.run(stack.start())
    yield stack
    stack.stop()


@pytest.fixture
async def client(budget_stack: Stack) -> AsyncIterator[TokenbusClient]:
    budget_stack.check()
    async with TokenbusClient(budget_stack.settings) as client:
        yield client


async def ask(client: TokenbusClient, tenant: str) -> TokenChunk:
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
    budget_stack: Stack, client: TokenbusClient
) -> None:
    settings = budget_stack.settings
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
    assert (spent, reserved) == (total, 0)  # exactly ClickHouse's sum
    # The bridge answers the same refusal in OpenAI's shape.
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            f"http://127.0.0.1:{settings.bridge_port}/v1/completions",
            headers={"Authorization": f"Bearer {HARD_KEY}"},
            json={"model": "tiny-llama", "prompt": "x", "max_tokens": 22},
        )
        metrics = (await http.get(f"http://127.0.0.1:{settings.faust_web_port}/metrics")).text
    assert answer.status_code == 429
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert 'tokenbus_job_budget_remaining_units{budget="tenant:bud-hard|month@UTC"' in metrics


async def test_a_key_s_budget_binds_inside_its_team_s(
    budget_stack: Stack, client: TokenbusClient
) -> None:
    # The case LiteLLM gets wrong: the key under a team-like tenant has its own budget.
    settings = budget_stack.settings
    async with TokenbusClient(settings, tenant_id="bud-team", credential=TEAM_KEY) as by_key:
        assert (await ask(by_key, "bud-team")).error is None
        assert (await ask(by_key, "bud-team")).error is None
        refused = await ask(by_key, "bud-team")  # 3 x 6,800 > the key's 20,000
    assert refused.error is not None and refused.error.code == "insufficient_quota"
    assert "key:" in refused.error.message
    # The tenant's other credentials still spend the rest of the tenant's 50,000.
    assert (await ask(client, "bud-team")).error is None


async def test_soft_alerts_reach_the_webhook_once_each_across_a_job_sigkill(
    budget_stack: Stack, client: TokenbusClient
) -> None:
    settings = budget_stack.settings
    Receiver.received.clear()

    def soft_thresholds() -> list[int]:
        found = []
        for headers, body in Receiver.received:
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
    await budget_stack.restart("stream_job")  # SIGKILL mid-period, between thresholds
    spent, reserved = job_spend(settings, "tenant:bud-soft|month@UTC")
    assert (spent, reserved) == (billed(settings, "bud-soft")[1], 0)  # no double, no loss
    assert (await ask(client, "bud-soft")).error is None  # 102%: soft, still admitted
    fired = await eventually(soft_thresholds, until=lambda t: len(t) >= 4, timeout_s=30)
    await asyncio.sleep(2)  # nothing more comes
    assert soft_thresholds() == fired == [50, 80, 95, 100]
    total = await until_billed(settings, "bud-soft", 3)
    assert job_spend(settings, "tenant:bud-soft|month@UTC") == (total, 0)


async def test_moving_the_clock_into_the_next_period_admits_again(
    budget_stack: Stack, client: TokenbusClient
) -> None:
    settings = budget_stack.settings
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
    budget_stack: Stack, client: TokenbusClient
) -> None:
    settings = budget_stack.settings
    claims = {"tenant": "bud-token", "aud": "tokenbus", "exp": int(time.time()) + 600}
    token = jwt.encode({**claims, "quota_balance": "0.00001"}, JWT_SECRET, algorithm="HS256")
    budget_id = f"key:{hashlib.sha256(token.encode()).hexdigest()}|total"
    async with TokenbusClient(settings, tenant_id="bud-token", credential=token) as by_token:
        assert (await ask(by_token, "bud-token")).error is None  # 6,800 of its 10,000
        refused = await ask(by_token, "bud-token")  # the tenant has 43,200 left
    assert refused.error is not None and refused.error.code == "insufficient_quota"
    assert budget_id in refused.error.message
    assert (await ask(client, "bud-token")).error is None  # the tenant's other credentials
    await until_billed(settings, "bud-token", 2)


async def test_alerts_land_in_clickhouse_and_the_job_reconciles_with_it(
    budget_stack: Stack,
) -> None:
    # After the tests above: every budget and bucket they spent in, alerts included.
    settings = budget_stack.settings

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
