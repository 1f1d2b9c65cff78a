"""Every service's /metrics on the real stack speaks one vocabulary: a few requests
through a bridge, then each service is scraped and read with prometheus_client's parser.

The bridge, the worker and the job label what they count about requests with the same
names (tenant, model, priority, worker); the bridge's and the worker's TTFT and
inter-token histograms count those requests; every consumer's lag is there."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.integration.conftest import ADMIN_AUTH, BridgeProcess, bridge_key, eventually
from tokenbus.config import Settings
from tokenbus_cli.stack import Stack

TENANT = "br-alice"
MODEL = "tiny-llama"


def scrape(url: str) -> list[Sample]:
    # The bridge's takes the admin key; the other services' listen on loopback only.
    response = httpx.get(url, headers=ADMIN_AUTH, timeout=10)
    assert response.status_code == 200, (url, response.text[:500])
    return [
        sample
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    ]


def page_text(url: str) -> str:
    return httpx.get(url, timeout=30).text


def named(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    return [
        s
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    return sum(s.value for s in named(samples, name, **labels))


def label_names(samples: Iterable[Sample], name: str) -> set[frozenset[str]]:
    return {frozenset(s.labels) - {"le", "code", "finish"} for s in named(samples, name)}


def complete(bridge: BridgeProcess, *, stream: bool) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": "count the tokens as they go by",
        "max_tokens": 12,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {bridge_key(TENANT)}"}
    with httpx.stream(
        "POST", f"{bridge.url}/v1/completions", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        for _ in response.iter_bytes():
            pass


def urls(stack: Stack, settings: Settings, bridge: BridgeProcess) -> dict[str, str]:
    worker_port = stack.service("worker-0").env["TOKENBUS_WORKER_METRICS_PORT"]
    local = "http://127.0.0.1"
    return {
        "bridge": f"{bridge.url}/metrics",
        "worker": f"{local}:{worker_port}/metrics",
        "job": f"{local}:{settings.faust_web_port}/metrics",
        "billing": f"{local}:{settings.billing_query_port}/metrics",
        "alerts": f"{local}:{settings.alerts_port}/metrics",
    }


async def test_every_service_scrapes_with_the_shared_labels_and_counted_histograms(
    stack: Stack, settings: Settings, bridge: BridgeProcess
) -> None:
    where = urls(stack, settings, bridge)
    before_worker = scrape(where["worker"])
    worker_ttft_before = total(
        before_worker, "tokenbus_worker_ttft_seconds_count", tenant=TENANT, model=MODEL
    )
    for stream in (True, True, True, False):
        complete(bridge, stream=stream)

    scraped = {name: scrape(url) for name, url in where.items()}
    bridge_s, worker_s, job_s = scraped["bridge"], scraped["worker"], scraped["job"]

    # One label vocabulary: the request series of the bridge and the worker.
    request = {"tenant", "model", "priority"}
    for name in (
        "tokenbus_bridge_completions_total",
        "tokenbus_bridge_ttft_seconds_bucket",
        "tokenbus_bridge_itl_seconds_bucket",
    ):
        assert label_names(bridge_s, name) == {frozenset(request)}, name
    for name in (
        "tokenbus_worker_requests_total",
        "tokenbus_worker_ttft_seconds_bucket",
        "tokenbus_worker_itl_seconds_bucket",
    ):
        assert label_names(worker_s, name) == {frozenset(request | {"worker"})}, name
    assert label_names(job_s, "tokenbus_job_worker_kv_cache_usage") == {
        frozenset({"worker", "model"})
    }

    # The histograms counted these requests: TTFT each, the inter-token gap each stream
    # (every request made more than one token), and the worker saw all four.
    mine = {"tenant": TENANT, "model": MODEL}
    assert total(bridge_s, "tokenbus_bridge_ttft_seconds_count", **mine) >= 4
    assert total(bridge_s, "tokenbus_bridge_itl_seconds_count", **mine) >= 4
    assert total(bridge_s, "tokenbus_bridge_completions_total", code="ok", **mine) >= 4
    assert total(worker_s, "tokenbus_worker_ttft_seconds_count", **mine) >= worker_ttft_before + 4
    assert total(worker_s, "tokenbus_worker_itl_seconds_count", **mine) >= 4
    assert total(worker_s, "tokenbus_worker_tokens_generated_total", **mine) >= 4 * 12
    assert named(worker_s, "tokenbus_worker_kv_cache_usage", worker="worker-0", model=MODEL)

    # Consumer lag, per topic and partition, in every service that consumes.
    assert named(bridge_s, "tokenbus_consumer_lag_records", consumer="replies")
    assert named(worker_s, "tokenbus_consumer_lag_records", topic="tokenbus.worker.worker-0")
    # The job holds every partition of the request topics (one instance).
    job_lag = await eventually(
        lambda: named(scrape(where["job"]), "tokenbus_consumer_lag_records", consumer="job"),
        until=lambda lag: len(lag) == 3 * settings.num_partitions,
    )
    assert {s.labels["topic"] for s in job_lag} == {f"tokenbus.requests.p{p}" for p in (0, 1, 2)}

    # The scaling signals.
    assert total(job_s, "tokenbus_model_workers", model=MODEL) >= 1
    assert total(job_s, "tokenbus_recommended_workers", model=MODEL) >= 1
    assert named(job_s, "tokenbus_job_quota_refusals_total")

    # Billing: rows, its lag, the usage consumer's lag; alerts through prometheus_client.
    billing = await eventually(
        lambda: scrape(where["billing"]),
        until=lambda s: total(s, "tokenbus_billing_rows_inserted_total") >= 4,
    )
    assert named(billing, "tokenbus_billing_lag_seconds")
    assert named(billing, "tokenbus_consumer_lag_records", consumer="billing_usage")
    assert named(scraped["alerts"], "tokenbus_budget_reconcile_runs_total")

    # The live view: the job's per-model and per-worker figures and the rows' TTFT.
    page = page_text(f"http://127.0.0.1:{settings.billing_query_port}/live")
    assert f"<td>{MODEL}</td>" in page and "<td>worker-0</td>" in page
    assert 'class="error"' not in page
