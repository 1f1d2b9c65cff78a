"""The job resolves ``base:adapter`` against the credential's tenant, never the producer.

Pure: a recording publisher, real API keys from a tenants file, two workers on the
base model (one without LoRA)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from schemas import FinishReason, UsageEvent, WorkerStatus, WorkItem, decode, encode
from stream_jobs.dispatcher import Dispatcher, Outcome, Record
from tests.unit.fakes import (
    TOPICS,
    ManualClock,
    Recorder,
    bearer,
    memory_dispatcher,
    reply_topic,
)
from tokenbus.config import Settings
from tokenbus.tenants import hash_api_key, lora_int_id
from tokenbus.usage import usage_of

NOW = float(int(datetime(2026, 3, 2, 10, 0, tzinfo=UTC).timestamp()))
ACME_KEY, BETA_KEY, GAMMA_KEY = "sk-acme", "sk-beta", "sk-gamma"
TENANTS = f"""
[tenants.acme]
sharing_group = "team"
api_key_sha256 = ["{hash_api_key(ACME_KEY)}"]
[tenants.acme.adapters.acme-support]
path = "/srv/adapters/acme-support"
base_model = "m"
[tenants.acme.adapters.acme-shared]
path = "/srv/adapters/acme-shared"
base_model = "m"
share_with_group = true

[tenants.beta]
api_key_sha256 = ["{hash_api_key(BETA_KEY)}"]

[tenants.gamma]
sharing_group = "team"
api_key_sha256 = ["{hash_api_key(GAMMA_KEY)}"]
"""


def heartbeat(worker_id: str, max_loras: int, *adapters: str) -> bytes:
    return encode(
        WorkerStatus(
            worker_id=worker_id,
            model="m",
            request_topic=f"tokenbus.worker.{worker_id}",
            max_num_seqs=8,
            max_loras=max_loras,
            adapters=list(adapters),
            incarnation="run-1",
        )
    )


@pytest.fixture
async def job(tmp_path: Path) -> AsyncIterator[tuple[Dispatcher, Recorder]]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    settings = Settings(home=tmp_path, tenants_file=tenants, vip_reserve=0.0)
    recorder = Recorder()
    dispatcher = memory_dispatcher(settings, recorder, allow_unlisted=False, clock=ManualClock(NOW))
    dispatcher.observe_heartbeat(heartbeat("base", 0))
    dispatcher.observe_heartbeat(heartbeat("lora", 2))
    loop = asyncio.create_task(dispatcher.run())
    yield dispatcher, recorder
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)


async def produce(
    dispatcher: Dispatcher, tenant: str, key: str, model: str, **fields: Any
) -> Outcome:
    body = {
        "request_id": f"{tenant}-{model}",
        "model": model,
        "prompt": "hello",
        "reply_to": reply_topic(tenant),
        "sampling": {"max_tokens": 8},
        **fields,
    }
    handled = dispatcher.handle_request(
        Record("p", 0, 0, tenant.encode(), orjson.dumps(body), bearer(key))
    )
    return await asyncio.wait_for(handled, 2)


async def test_the_adapter_comes_from_the_tenants_file(
    job: tuple[Dispatcher, Recorder],
) -> None:
    dispatcher, recorder = job
    assert await produce(dispatcher, "acme", ACME_KEY, "m:acme-support") is Outcome.FORWARDED

    (raw,) = recorder.on("tokenbus.worker.lora")  # never the worker without LoRA
    item = decode(WorkItem, raw)
    assert item.model == "m" and item.requested_model == "m:acme-support"
    assert item.adapter is not None
    assert (item.adapter.name, item.adapter.path) == ("acme-support", "/srv/adapters/acme-support")
    assert item.adapter.lora_int_id == lora_int_id("acme-support", "/srv/adapters/acme-support")
    usage = usage_of(item, FinishReason.STOP)
    assert (usage.model, usage.adapter) == ("m", "acme-support")


@pytest.mark.parametrize(
    ("tenant", "key", "model"),
    [
        ("beta", BETA_KEY, "m:acme-support"),  # another tenant's
        ("beta", BETA_KEY, "m:acme-shared"),  # shared, but not with beta's group
        ("gamma", GAMMA_KEY, "m:acme-support"),  # same group, not shared
        ("acme", ACME_KEY, "other:acme-support"),  # not on that base
        ("acme", ACME_KEY, "m:no-such-adapter"),  # no one's: the same answer
    ],
)
async def test_an_adapter_the_tenant_may_not_use_is_refused(
    job: tuple[Dispatcher, Recorder], tenant: str, key: str, model: str
) -> None:
    dispatcher, recorder = job
    assert await produce(dispatcher, tenant, key, model) is Outcome.REFUSED

    (chunk,) = recorder.chunks_on(reply_topic(tenant))
    assert chunk.error is not None and chunk.error.code == "model_not_allowed"
    (usage,) = [decode(UsageEvent, v) for v in recorder.on(TOPICS.usage)]
    assert (usage.status, usage.error_code) == ("rejected", "model_not_allowed")
    assert not recorder.on("tokenbus.worker.lora") and not recorder.on("tokenbus.worker.base")


async def test_the_group_uses_what_is_shared(job: tuple[Dispatcher, Recorder]) -> None:
    dispatcher, recorder = job
    assert await produce(dispatcher, "gamma", GAMMA_KEY, "m:acme-shared") is Outcome.FORWARDED
    (raw,) = recorder.on("tokenbus.worker.lora")
    assert decode(WorkItem, raw).tenant_id == "gamma"


async def test_a_producer_cannot_name_an_adapter_path(job: tuple[Dispatcher, Recorder]) -> None:
    dispatcher, recorder = job
    adapter = {"name": "acme-support", "path": "/etc", "lora_int_id": 1}
    outcome = await produce(dispatcher, "beta", BETA_KEY, "m", adapter=adapter)
    assert outcome is Outcome.REFUSED
    (chunk,) = recorder.chunks_on(reply_topic("beta"))
    assert chunk.error is not None and "adapter: set by tokenbus" in chunk.error.message


async def test_no_worker_with_lora_is_no_worker(job: tuple[Dispatcher, Recorder]) -> None:
    dispatcher, recorder = job
    dispatcher.observe_heartbeat(heartbeat("lora", 0))  # restarted without LoRA
    assert await produce(dispatcher, "acme", ACME_KEY, "m:acme-support") is Outcome.REFUSED
    (chunk,) = recorder.chunks_on(reply_topic("acme"))
    assert chunk.error is not None and chunk.error.code == "no_worker"
    assert "m:acme-support" in chunk.error.message
