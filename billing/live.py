"""The live view: the fleet now, per model and per worker, and the batches running. Pure,
but for ``fetch_text``.

# the job's /metrics (its queue; the workers' heartbeats it holds) --> per model and worker
# usage rows of the last minutes (ClickHouse) --> TTFT p50/p99 per model
# the batch runner's /metrics --> each running batch's progress
# --> LiveView --> billing.html.render_live

Sources, and why: the job is the one service that sees the whole fleet, its queue by
model and every worker's last heartbeat (running, waiting, KV use, tokens/s), so its
``/metrics`` is read rather than each worker's. TTFT is the billed rows' own (from the
request's creation to its first token, as the worker reported it), exact quantiles over
the last ``window_s`` seconds, so the view needs no Prometheus server.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from billing.queries import parse_query

LIVE_TTFT = parse_query(
    "live_ttft_by_model",
    """-- TTFT by model, last minutes
-- p50 and p99 time to first token (ms) of the attempts created in the last window_s
-- seconds that produced a token, per model.
-- @param window_s = 300  the window, in seconds
SELECT
    model,
    count() AS num_attempts,
    quantileExactInclusive(0.5)(ttft_ms) AS p50_ttft_ms,
    quantileExactInclusive(0.99)(ttft_ms) AS p99_ttft_ms
FROM usage_events FINAL
WHERE created_at >= now64(3) - toIntervalSecond({window_s:UInt32})
  AND ttft_ms IS NOT NULL
GROUP BY model
ORDER BY model
""",
)


@dataclass
class ModelNow:
    model: str
    num_queued: float = 0.0
    """In the job's queue."""
    num_waiting: float = 0.0
    """The job's queue and the engines' queues."""
    num_running: float = 0.0
    num_workers: float = 0.0
    num_recommended: float | None = None
    tokens_per_s: float = 0.0
    p50_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    num_attempts: int = 0


@dataclass
class WorkerNow:
    worker: str
    model: str
    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_cache_usage: float = 0.0
    tokens_per_s: float = 0.0


@dataclass
class BatchNow:
    tenant: str
    batch: str
    num_completed: int = 0
    num_failed: int = 0
    num_remaining: int = 0
    num_in_flight: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    eta_s: float | None = None


@dataclass
class LiveView:
    models: list[ModelNow] = field(default_factory=list)
    workers: list[WorkerNow] = field(default_factory=list)
    batches: list[BatchNow] = field(default_factory=list)


def fetch_text(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


_WORKER_GAUGES = {
    "tokenbus_job_worker_num_running": "num_running",
    "tokenbus_job_worker_num_waiting": "num_waiting",
    "tokenbus_job_worker_kv_cache_usage": "kv_cache_usage",
    "tokenbus_job_worker_tokens_per_s": "tokens_per_s",
}
_MODEL_GAUGES = {
    "tokenbus_model_requests_waiting": "num_waiting",
    "tokenbus_model_requests_running": "num_running",
    "tokenbus_model_workers": "num_workers",
    "tokenbus_recommended_workers": "num_recommended",
}


_BATCH_LINES = {
    "completed": "num_completed",
    "failed": "num_failed",
    "remaining": "num_remaining",
    "in_flight": "num_in_flight",
}


def batch_progress(runner_metrics: str) -> list[BatchNow]:
    """Each batch the runner drives now, from its ``tokenbus_batch_*`` gauges."""
    batches: dict[tuple[str, str], BatchNow] = {}
    for family in text_string_to_metric_families(runner_metrics):
        for sample in family.samples:
            labels = sample.labels
            if "batch" not in labels:
                continue
            key = (labels["tenant"], labels["batch"])
            batch = batches.setdefault(key, BatchNow(*key))
            if sample.name == "tokenbus_batch_lines" and labels.get("state") in _BATCH_LINES:
                setattr(batch, _BATCH_LINES[labels["state"]], int(sample.value))
            elif sample.name == "tokenbus_batch_tokens":
                kind = "prompt_tokens" if labels.get("kind") == "prompt" else "completion_tokens"
                setattr(batch, kind, int(sample.value))
            elif sample.name == "tokenbus_batch_eta_seconds":
                batch.eta_s = None if sample.value < 0 else sample.value
    return [batches[key] for key in sorted(batches)]


def live_view(
    job_metrics: str, ttft_rows: Iterable[Mapping[str, Any]], batch_metrics: str = ""
) -> LiveView:
    """The job's metrics text and the TTFT rows, joined by model; the runner's batches."""
    models: dict[str, ModelNow] = {}
    workers: dict[str, WorkerNow] = {}

    def model(name: str) -> ModelNow:
        return models.setdefault(name, ModelNow(name))

    for family in text_string_to_metric_families(job_metrics):
        for sample in family.samples:
            labels = sample.labels
            if sample.name in _WORKER_GAUGES:
                worker = workers.setdefault(
                    labels["worker"], WorkerNow(labels["worker"], labels.get("model", ""))
                )
                setattr(worker, _WORKER_GAUGES[sample.name], sample.value)
            elif sample.name in _MODEL_GAUGES:
                setattr(model(labels["model"]), _MODEL_GAUGES[sample.name], sample.value)
            elif sample.name == "tokenbus_job_queue_depth":
                model(labels["model"]).num_queued += sample.value
    for worker in workers.values():
        model(worker.model).tokens_per_s += worker.tokens_per_s
    for row in ttft_rows:
        now = model(str(row["model"]))
        now.num_attempts = int(row["num_attempts"])
        now.p50_ttft_ms = float(row["p50_ttft_ms"])
        now.p99_ttft_ms = float(row["p99_ttft_ms"])
    return LiveView(
        models=[models[name] for name in sorted(models)],
        workers=[workers[name] for name in sorted(workers)],
        batches=batch_progress(batch_metrics),
    )
