"""The capacity model: what GPUs at H100 rates ask of tokenbus, from measured costs.

Pure arithmetic on the figures ``bench/summary.json`` holds (``costs_from_summary``), so
the model in BENCHMARKS.md moves when the figures do. Per GPU: cores of the Faust job,
the worker loop, the SSE bridge and the billing sink; the job's per request grows with
the workers a pick reads (a fleet taken to serve one model, the most a pick can read).
Per fleet: instances of each, and what the broker carries in records/s and bytes/s once
chunks coalesce (a worker sends one reply record per engine step per reply topic and
tenant, ``TokenChunkBatch``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuRates:
    """One GPU serving an 8B model on an H100 (the issue's planning rates)."""

    tokens_per_s: float = 5_500
    requests_per_s: float = 20
    step_ms: float = 20
    """One decode step of the whole running batch: every running request's next token."""
    num_tenants: int = 100
    """Tenants with a request running at once: each reply record holds one tenant's."""

    @property
    def num_running(self) -> float:
        """Requests in the running batch: tokens/s over steps/s (Little's law)."""
        return self.tokens_per_s * self.step_ms / 1000


@dataclass(frozen=True)
class Costs:
    """Measured CPU costs and record sizes (medians from ``bench/summary.json``)."""

    job_us_per_request: float
    """Measured with one worker (``bench.admission``): the pick reads one."""
    pick_us_per_worker: float
    """What a pick adds per live worker of the request's model (``bench.route_cost``)."""
    billing_us_per_event: float
    worker_loop_us_per_token: float
    """``bench.relay`` at one token per chunk, with ``relay_tokens_per_record`` per record."""
    bridge_us_per_token: float
    broker_us_per_token: float
    """The bundled broker (tansu) in the same relay run: not Apache Kafka's cost."""
    relay_tokens_per_record: float
    """Tokens per reply record in that relay run (``relay_tokens_per_record()``)."""
    request_record_bytes: float
    reply_record_bytes: float
    """A reply record of one chunk."""
    reply_bytes_per_extra_chunk: float
    usage_record_bytes: float


KAFKA_PARTITION_MB_S = 10.0
"""Produce throughput of one partition, the low end of "10s of MB/sec" (Confluent)."""
INSTANCE_CORES = 0.7
"""Each service is one Python process (one core at most): size it to run at 70%."""
FLEETS = (8, 64, 512)

# Where each cost comes from in the summary.
SOURCES: dict[str, str] = {
    "job_us_per_request": "admission.job_us_per_request",
    "pick_us_per_worker": "route_cost.us_per_pick_per_worker",
    "billing_events_per_core_s": "billing.events_per_core_s",
    "worker_loop_us_per_token": "relay.worker_loop_us_per_token",
    "bridge_tokens_per_core_s": "bridge.tokens_per_core_s",
    "broker_us_per_token": "relay.broker_us_per_token",
    "relay_tokens_per_record": "relay.tokens_per_record",
    "request_record_bytes": "admission.request_record_bytes",
}


def costs_from_summary(summary: Mapping[str, Any]) -> tuple[Costs | None, list[str]]:
    """The costs, or None and the summary figures that are missing."""
    figures = summary.get("figures", {})
    sizes = summary.get("record_bytes", {})
    missing = [key for key in SOURCES.values() if key not in figures]
    missing += [
        f"record_bytes.{k}"
        for k in ("reply_record_one_chunk", "reply_record_per_extra_chunk", "usage_event")
        if k not in sizes
    ]
    if missing:
        return None, missing

    def median(name: str) -> float:
        return float(figures[SOURCES[name]]["median"])

    return (
        Costs(
            job_us_per_request=median("job_us_per_request"),
            pick_us_per_worker=median("pick_us_per_worker"),
            billing_us_per_event=1e6 / median("billing_events_per_core_s"),
            worker_loop_us_per_token=median("worker_loop_us_per_token"),
            bridge_us_per_token=1e6 / median("bridge_tokens_per_core_s"),
            broker_us_per_token=median("broker_us_per_token"),
            relay_tokens_per_record=median("relay_tokens_per_record"),
            request_record_bytes=median("request_record_bytes"),
            reply_record_bytes=float(sizes["reply_record_one_chunk"]),
            reply_bytes_per_extra_chunk=float(sizes["reply_record_per_extra_chunk"]),
            usage_record_bytes=float(sizes["usage_event"]),
        ),
        [],
    )


def job_us_per_request(costs: Costs, num_workers: int) -> float:
    """The job's CPU per request when the request's model has ``num_workers`` live
    workers: every pick reads each of them (``bench.route_cost``)."""
    return costs.job_us_per_request + costs.pick_us_per_worker * max(0, num_workers - 1)


def cores_per_gpu(costs: Costs, rates: GpuRates, num_gpus: int = 1) -> dict[str, float]:
    """CPU cores the job, the bridge and the billing sink need for one GPU's traffic in a
    fleet of ``num_gpus`` serving one model (a worker per GPU): costs per request and per
    token, whatever the records carry."""
    return {
        "stream_job": rates.requests_per_s * job_us_per_request(costs, num_gpus) / 1e6,
        "bridge": rates.tokens_per_s * costs.bridge_us_per_token / 1e6,
        "billing": rates.requests_per_s * costs.billing_us_per_event / 1e6,
    }


def relay_tokens_per_record(concurrency: int, num_tenants: int, tokens_per_step: int) -> float:
    """Tokens in each reply record of a ``bench.relay`` run (estimated): one client, so
    one reply topic, and a record per tenant with requests in the step."""
    return concurrency * tokens_per_step / distinct_keys(num_tenants, concurrency)


def cores_between(
    us_per_token: float, relay_tokens_per_record: float, tokens_per_s: float, records_per_s: float
) -> tuple[float, float]:
    """Cores for a cost measured per token at the relay's records: as low as if it were all
    per token, as high as if it were all per record (records here carry other counts)."""
    per_token = tokens_per_s * us_per_token / 1e6
    per_record = records_per_s * us_per_token * relay_tokens_per_record / 1e6
    return min(per_token, per_record), max(per_token, per_record)


def instances(cores: float) -> int:
    """Processes that carry ``cores`` of work at ``INSTANCE_CORES`` each."""
    return max(1, math.ceil(cores / INSTANCE_CORES - 1e-9))


def distinct_keys(num_keys: float, num_running: float) -> float:
    """Expected distinct (reply topic, tenant) pairs among ``num_running`` requests spread
    evenly over ``num_keys`` pairs: the reply records one engine step makes."""
    if num_keys <= 1:
        return min(1.0, num_running)
    return num_keys * (1 - float((1 - 1 / num_keys) ** num_running))


@dataclass(frozen=True)
class Fleet:
    num_gpus: int
    cores: dict[str, float]
    """Fleet-wide cores per process kind."""
    instances: dict[str, int]
    reply_records_per_s: float
    tokens_per_reply_record: float
    request_records_per_s: float
    """Requests, work items and usage events: three records per request."""
    bytes_per_s: float
    reply_mb_s_per_topic: float
    """Each bridge reads one reply topic: what its partition carries."""
    worker_loop_cores: tuple[float, float]
    """Fleet-wide, low..high (``cores_between``); one worker loop per GPU."""
    broker_cores_tansu: tuple[float, float]

    @property
    def records_per_s(self) -> float:
        return self.reply_records_per_s + self.request_records_per_s

    @property
    def reply_records_per_s_per_topic(self) -> float:
        return self.reply_records_per_s / self.instances["bridge"]

    @property
    def partition_share(self) -> float:
        """The busiest reply partition's MB/s over ``KAFKA_PARTITION_MB_S``."""
        return self.reply_mb_s_per_topic / KAFKA_PARTITION_MB_S


def fleet(costs: Costs, rates: GpuRates, num_gpus: int) -> Fleet:
    per_gpu = cores_per_gpu(costs, rates, num_gpus)
    cores = {name: value * num_gpus for name, value in per_gpu.items()}
    counts = {name: instances(value) for name, value in cores.items()}
    steps_per_s = 1000 / rates.step_ms
    keys = counts["bridge"] * rates.num_tenants
    records_per_step = distinct_keys(keys, rates.num_running)
    reply_records = num_gpus * steps_per_s * records_per_step
    tokens = num_gpus * rates.tokens_per_s
    tokens_per_record = tokens / reply_records
    reply_bytes = reply_records * (
        costs.reply_record_bytes + (tokens_per_record - 1) * costs.reply_bytes_per_extra_chunk
    )
    requests = num_gpus * rates.requests_per_s
    # A work item is the request with what the job adds: counted at the request's size.
    request_bytes = requests * (2 * costs.request_record_bytes + costs.usage_record_bytes)
    return Fleet(
        num_gpus=num_gpus,
        cores=cores,
        instances=counts,
        reply_records_per_s=reply_records,
        tokens_per_reply_record=tokens_per_record,
        request_records_per_s=3 * requests,
        bytes_per_s=reply_bytes + request_bytes,
        reply_mb_s_per_topic=reply_bytes / counts["bridge"] / 1e6,
        worker_loop_cores=cores_between(
            costs.worker_loop_us_per_token, costs.relay_tokens_per_record, tokens, reply_records
        ),
        broker_cores_tansu=cores_between(
            costs.broker_us_per_token, costs.relay_tokens_per_record, tokens, reply_records
        ),
    )
