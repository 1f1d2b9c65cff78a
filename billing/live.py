"""The live view: the fleet now, per model and per worker, and the batches running. Pure,
but for ``fetch_text``.

# the job's /metrics (its queue; the workers' heartbeats it holds) --> per model and worker
# usage rows of the last minutes (ClickHouse) --> TTFT p50/p99 per model
# the same rows, per request --> the slowest requests, each linked to its trace page
# the batch runner's /metrics --> each running batch's progress
# --> LiveView --> billing.html.render_live

Sources, and why: the job is the one service that sees the whole fleet, its queue by
model and every worker's last heartbeat (running, waiting, KV use, tokens/s), so its
``/metrics`` is read rather than each worker's. TTFT is the billed rows' own (from the
request's creation to its first token, as the worker reported it), exact quantiles over
the last ``window_s`` seconds, so the view needs no Prometheus server. The slowest
requests are the tail of that same distribution, over the same window (the handler
passes ``LIVE_TTFT``'s window to ``LIVE_SLOWEST``), one row per request.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from billing.queries import QueryParamError, parse_query
from schemas import TENANT_ID_PATTERN

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

LIVE_SLOWEST = parse_query(
    "live_slowest_requests",
    """-- Slowest recent requests
-- The requests created in the last window_s seconds whose first token came last, one
-- row per request (tenant, request id): its TTFT is the earliest first token any of its
-- attempts reported, from the request's creation (the TTFT the live p50/p99 count),
-- and its duration runs from its creation to its last attempt's end. A request that
-- produced no token has no TTFT and is not ranked. Tokens are summed over its
-- attempts; the status is its last attempt's. Ties go to tenant, then request.
-- @param window_s = 300  the window, in seconds
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param limit = 10  how many requests
SELECT
    tenant_id,
    request_id,
    any(model) AS model,
    min(ttft_ms) AS first_token_ms,
    max(total_ms) AS duration_ms,
    sum(prompt_tokens) AS num_prompt_tokens,
    sum(completion_tokens) AS num_completion_tokens,
    argMax(status, attempt) AS last_status,
    count() AS num_attempts
FROM usage_events FINAL
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND created_at >= now64(3) - toIntervalSecond({window_s:UInt32})
GROUP BY tenant_id, request_id
HAVING first_token_ms IS NOT NULL
ORDER BY first_token_ms DESC, tenant_id, request_id
LIMIT {limit:UInt32}
""",
)

SLOWEST_DEFAULT_LIMIT = 10
SLOWEST_MAX_LIMIT = 100
"""What ``?limit=`` may ask of the slowest-requests table: more is capped to this."""
_TENANT = re.compile(TENANT_ID_PATTERN)


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
class SlowRequest:
    """One request among the slowest of the window (``LIVE_SLOWEST``'s row)."""

    tenant: str
    request_id: str
    model: str
    ttft_ms: float
    duration_ms: float
    num_prompt_tokens: int
    num_completion_tokens: int
    status: str
    num_attempts: int


@dataclass
class LiveView:
    models: list[ModelNow] = field(default_factory=list)
    workers: list[WorkerNow] = field(default_factory=list)
    batches: list[BatchNow] = field(default_factory=list)
    slowest: list[SlowRequest] = field(default_factory=list)
    slowest_tenant: str = ""
    """The tenant the slowest requests were chosen from; every tenant when empty."""


def slowest_params(query: Mapping[str, str], window_s: str) -> dict[str, str]:
    """``LIVE_SLOWEST``'s parameters from the page's URL (``tenant``, ``limit``) and the
    TTFT query's window; a malformed value raises ``QueryParamError`` with the reason."""
    tenant = query.get("tenant", "")
    if tenant and not _TENANT.fullmatch(tenant):
        raise QueryParamError(
            "tenant must be 1 to 128 letters, digits, '_' or '-' (or empty: every tenant)"
        )
    raw = query.get("limit", "") or str(SLOWEST_DEFAULT_LIMIT)
    if not raw.isascii() or not raw.isdigit() or int(raw) < 1:
        raise QueryParamError(f"limit must be a whole number from 1 (at most {SLOWEST_MAX_LIMIT})")
    limit = min(int(raw), SLOWEST_MAX_LIMIT)
    return {"window_s": window_s, "tenant": tenant, "limit": str(limit)}


def slowest_requests(rows: Iterable[Mapping[str, Any]]) -> list[SlowRequest]:
    """``LIVE_SLOWEST``'s rows, in its order (slowest first)."""
    return [
        SlowRequest(
            tenant=str(row["tenant_id"]),
            request_id=str(row["request_id"]),
            model=str(row["model"]),
            ttft_ms=float(row["first_token_ms"]),
            duration_ms=float(row["duration_ms"]),
            num_prompt_tokens=int(row["num_prompt_tokens"]),
            num_completion_tokens=int(row["num_completion_tokens"]),
            status=str(row["last_status"]),
            num_attempts=int(row["num_attempts"]),
        )
        for row in rows
    ]


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
    job_metrics: str,
    ttft_rows: Iterable[Mapping[str, Any]],
    batch_metrics: str = "",
    slowest_rows: Iterable[Mapping[str, Any]] = (),
    slowest_tenant: str = "",
) -> LiveView:
    """The job's metrics text and the TTFT rows, joined by model; the runner's batches;
    the slowest requests (of ``slowest_tenant``, or of every tenant)."""
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
        slowest=slowest_requests(slowest_rows),
        slowest_tenant=slowest_tenant,
    )
