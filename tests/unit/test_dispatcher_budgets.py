"""Spend budgets in the dispatcher: reserve on admission, settle on usage, refuse, alert.

No tokenizer here: "hello" counts 6 prompt tokens. The bundled prices give model "m"
the "*" entry (0.0005 in, 0.0015 out per 1k): a request with max_tokens 10 reserves
6 x 500 + 10 x 1500 = 18,000 nano-units; one that used 4 is billed 9,000.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas import UsageEvent, UsageStatus, WorkItem, decode, encode
from schemas.budgets import BudgetAlert
from stream_jobs.dispatcher import Dispatcher, Outcome, Record
from tests.unit.fakes import Recorder, bearer, reply_topic, service_headers
from tests.unit.test_dispatcher import admit, dispatcher_for, heartbeat, request
from tokenbus.budget_config import BudgetConfig
from tokenbus.config import Settings
from tokenbus.tenants import hash_api_key

KEY = "sk-team-key-0123456789"
ALERTS = "tokenbus.budget-alerts"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    tenants = {
        "tenants": {
            "team": {
                "api_key_sha256": [hash_api_key(KEY)],
                "budgets": [
                    {"limit": "0.00005", "period": "month"},  # 2 reservations fit
                    {"key_sha256": hash_api_key(KEY), "limit": "0.00002", "period": "day"},
                ],
            },
            "soft": {"budgets": [{"limit": "0.00002", "enforce": "soft"}]},
        }
    }
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(tenants))
    return Settings(home=tmp_path, tenants_file=path, worker_dead_after_s=0.3)


def usage(n: int, tenant: str, num_completion: int = 4, attempt: int = 0) -> bytes:
    return encode(
        UsageEvent(
            request_id=f"r{n}",
            session_id="s",
            tenant_id=tenant,
            model="m",
            status=UsageStatus.OK,
            attempt=attempt,
            num_prompt_tokens=6,
            num_completion_tokens=num_completion,
            created_at=datetime.now(UTC),
        )
    )


async def running(settings: Settings, recorder: Recorder) -> tuple[Dispatcher, asyncio.Task[None]]:
    dispatcher = dispatcher_for(settings, recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=50))
    return dispatcher, asyncio.create_task(dispatcher.run())


async def test_a_hard_budget_refuses_what_would_cross_it_in_openai_s_terms(
    settings: Settings,
) -> None:
    recorder = Recorder()
    dispatcher, loop = await running(settings, recorder)
    for n in (1, 2):
        assert await (await admit(dispatcher, request(n, tenant="team"))) is Outcome.FORWARDED
    assert await (await admit(dispatcher, request(3, tenant="team"))) is Outcome.REFUSED
    refusal = recorder.chunks_on(reply_topic("team"))[-1]
    assert refusal.error is not None and refusal.error.code == "insufficient_quota"
    assert "tenant:team|month@UTC" in refusal.error.message
    assert refusal.error.retry_after_s is not None and refusal.error.retry_after_s > 0
    (alert,) = [decode(BudgetAlert, v) for v in recorder.on(ALERTS)]
    assert (alert.threshold, alert.reason, alert.entity) == (100, "refused", "tenant:team")
    # Settling on the billed cost frees the rest of the reservation.
    dispatcher.observe_usage(usage(1, "team"))
    await dispatcher.publish_raised()
    (row,) = [r for r in dispatcher.budget_rows() if r["entity"] == "tenant:team"]
    assert (row["spent"], row["reserved"]) == ("0.000009000", "0.000018000")
    assert await (await admit(dispatcher, request(4, tenant="team"))) is Outcome.FORWARDED
    assert dispatcher.metrics.num_rejected_budget == 1
    loop.cancel()


async def test_a_key_s_own_budget_binds_inside_its_tenant_s(settings: Settings) -> None:
    # The case LiteLLM gets wrong: a key of a team-like tenant, with a budget of its own.
    recorder = Recorder()
    dispatcher, loop = await running(settings, recorder)
    keyed = request(1, tenant="team")

    async def by_key(n: int) -> Outcome:
        req = keyed.model_copy(update={"request_id": f"r{n}"})
        return await dispatcher.handle_request(Record("p", 0, 0, b"team", encode(req), bearer(KEY)))

    assert await by_key(1) is Outcome.FORWARDED
    # The key travels with the work to its UsageEvent, so ClickHouse can sum it.
    (forwarded,) = [decode(WorkItem, v) for v in recorder.on("tokenbus.worker.w")]
    assert forwarded.key_sha256 == hash_api_key(KEY)
    assert await by_key(2) is Outcome.REFUSED  # the key's 20,000: smaller than the tenant's
    refusal = recorder.chunks_on(reply_topic("team"))[-1]
    assert refusal.error is not None and f"key:{hash_api_key(KEY)}" in refusal.error.message
    # The tenant's other credentials still have the tenant's remainder, 32,000: one more.
    assert await (await admit(dispatcher, request(3, tenant="team"))) is Outcome.FORWARDED
    assert await (await admit(dispatcher, request(4, tenant="team"))) is Outcome.REFUSED
    loop.cancel()


async def test_a_soft_budget_only_alerts_each_threshold_once(settings: Settings) -> None:
    recorder = Recorder()
    dispatcher, loop = await running(settings, recorder)
    for n in range(4):  # 9,000 each against 20,000: 45%, 90%, 135%, 180%
        assert await (await admit(dispatcher, request(n, tenant="soft"))) is Outcome.FORWARDED
        dispatcher.observe_usage(usage(n, "soft"))
        dispatcher.observe_usage(usage(n, "soft"))  # a redelivery: counted once
        await dispatcher.publish_raised()
    fired = [decode(BudgetAlert, v) for v in recorder.on(ALERTS)]
    assert [a.threshold for a in fired] == [50, 80, 95, 100]
    assert all(a.reason == "threshold" and a.enforce == "soft" for a in fired)
    assert fired[0].spent_units == "0.000018000"
    assert len({a.alert_id for a in fired}) == 4
    loop.cancel()


async def test_a_budget_set_at_runtime_binds_and_can_be_removed(settings: Settings) -> None:
    recorder = Recorder()
    dispatcher, loop = await running(settings, recorder)
    config = BudgetConfig(tenant="free", limit="0.00001", period="day")  # type: ignore[arg-type]
    budget_id = config.budget_id("UTC").encode()
    dispatcher.observe_budget(budget_id, config.model_dump_json().encode())
    assert await (await admit(dispatcher, request(1, tenant="free"))) is Outcome.REFUSED
    dispatcher.observe_budget(budget_id, None)
    assert await (await admit(dispatcher, request(2, tenant="free"))) is Outcome.FORWARDED
    loop.cancel()


async def test_a_token_s_balance_binds_inside_its_tenant_s_budget(settings: Settings) -> None:
    # The bridge relays a JWT caller's quota_balance (cost units) and the JWT's hash.
    recorder = Recorder()
    dispatcher, loop = await running(settings, recorder)
    token = "ef" * 32

    async def by_token(n: int) -> Outcome:
        headers = service_headers("team", quota_balance="0.00002", key_sha256=token)
        req = encode(request(n, tenant="team"))
        return await dispatcher.handle_request(Record("p", 0, 0, b"team", req, headers))

    assert await by_token(1) is Outcome.FORWARDED  # reserves 18,000 of the 20,000
    assert await by_token(2) is Outcome.REFUSED  # the tenant has 32,000 left: the token binds
    refusal = recorder.chunks_on(reply_topic("team"))[-1]
    assert refusal.error is not None and refusal.error.code == "insufficient_quota"
    assert f"key:{token}|total" in refusal.error.message
    assert refusal.error.retry_after_s is None  # a balance does not turn
    assert recorder.on(ALERTS) == []  # whoever minted the token set it: no alert
    dispatcher.observe_usage(usage(1, "team"))
    (bucket,) = [b for b in dispatcher.budget_buckets() if b["budget_id"] == f"key:{token}|total"]
    assert (bucket["spent"], bucket["start"]) == ("0.000009000", "1970-01-01T00:00:00+00:00")
    assert await by_token(3) is Outcome.REFUSED  # 11,000 left, 18,000 asked
    assert await (await admit(dispatcher, request(4, tenant="team"))) is Outcome.FORWARDED
    loop.cancel()
