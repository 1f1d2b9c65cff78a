"""The operations dashboard: Grafana panels over every service's Prometheus metrics.

``python -m billing.grafana_ops > billing/dashboards/operations.json`` regenerates the
checked-in file; a unit test keeps the two in step, and checks that every metric a
panel queries is one a tokenbus service exports. It sits beside the billing dashboard
(``billing.grafana``), which reads ClickHouse; this one reads Prometheus.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from billing.grafana import dashboard

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

_Panel = tuple[str, str, str, list[tuple[str, str]]]
"""(title, description, unit, [(legend, PromQL)])."""

PANELS: list[_Panel] = [
    (
        "Completions per second by model",
        "Completions the bridges answered, by outcome ok or not.",
        "reqps",
        [
            (
                "{{model}} ok",
                'sum by (model) (rate(tokenbus_bridge_completions_total{code="ok"}[1m]))',
            ),
            (
                "{{model}} {{code}}",
                'sum by (model, code) (rate(tokenbus_bridge_completions_total{code!="ok"}[1m]))',
            ),
        ],
    ),
    (
        "HTTP answers by status",
        "Every HTTP answer of the bridges, by endpoint and status.",
        "reqps",
        [
            (
                "{{endpoint}} {{status}}",
                "sum by (endpoint, status) (rate(tokenbus_bridge_requests_total[1m]))",
            )
        ],
    ),
    (
        "TTFT p50 / p99 by model (bridge)",
        "From the request received by the bridge to its first chunk.",
        "s",
        [
            (
                f"{{{{model}}}} p{q}",
                f"histogram_quantile(0.{q}, sum by (le, model) "
                "(rate(tokenbus_bridge_ttft_seconds_bucket[5m])))",
            )
            for q in ("5", "99")
        ],
    ),
    (
        "TTFT p99 by tenant (bridge)",
        "Top tenants by name, the rest as other (metrics_top_tenants).",
        "s",
        [
            (
                "{{tenant}}",
                "histogram_quantile(0.99, sum by (le, tenant) "
                "(rate(tokenbus_bridge_ttft_seconds_bucket[5m])))",
            )
        ],
    ),
    (
        "Inter-token latency p50 / p99 by model (workers)",
        "Each request's mean gap between tokens after the first, on its worker.",
        "s",
        [
            (
                f"{{{{model}}}} p{q}",
                f"histogram_quantile(0.{q}, sum by (le, model) "
                "(rate(tokenbus_worker_itl_seconds_bucket[5m])))",
            )
            for q in ("5", "99")
        ],
    ),
    (
        "Engine TTFT p99 by worker",
        "From the worker taking a request to its first token: vLLM's queue and prefill.",
        "s",
        [
            (
                "{{worker}}",
                "histogram_quantile(0.99, sum by (le, worker) "
                "(rate(tokenbus_worker_ttft_seconds_bucket[5m])))",
            )
        ],
    ),
    (
        "Tokens per second",
        "By model, as the engines report it; by tenant, from the tokens workers generated.",
        "short",
        [
            ("{{model}}", "sum by (model) (tokenbus_worker_tokens_per_s)"),
            ("{{tenant}}", "sum by (tenant) (rate(tokenbus_worker_tokens_generated_total[1m]))"),
        ],
    ),
    (
        "Queue depth by class (job)",
        "Requests admitted and waiting for a seat, by priority class and model.",
        "short",
        [("p{{priority}} {{model}}", "sum by (priority, model) (tokenbus_job_queue_depth)")],
    ),
    (
        "Queue wait p99 by class (job)",
        "From admission to forward, over the last 1,000 requests of each class.",
        "ms",
        [("p{{priority}}", 'max by (priority) (tokenbus_job_queue_ms{quantile="0.99"})')],
    ),
    (
        "Quota refusals by reason",
        "The TPM/RPM window's reasons, spend budgets, and shedding by the overload tier.",
        "reqps",
        [("{{reason}}", "sum by (reason) (rate(tokenbus_job_quota_refusals_total[5m]))")],
    ),
    (
        "Overload tier",
        "0 normal, 1 max_tokens capped, 2 batch shed.",
        "short",
        [("tier", "max(tokenbus_job_tier)")],
    ),
    (
        "KV cache use by worker",
        "Share of each worker's KV-cache blocks in use.",
        "percentunit",
        [("{{worker}}", "max by (worker) (tokenbus_worker_kv_cache_usage)")],
    ),
    (
        "Running and waiting by model",
        "Running in the engines; waiting in the job's queue and the engines' queues.",
        "short",
        [
            ("{{model}} running", "sum by (model) (tokenbus_model_requests_running)"),
            ("{{model}} waiting", "sum by (model) (tokenbus_model_requests_waiting)"),
        ],
    ),
    (
        "Workers: live and recommended",
        "recommended = ceil((running + waiting) / (max_num_seqs x target_utilisation)), "
        "within [min, max]: what KEDA scales on (deploy/keda.yaml).",
        "short",
        [
            ("{{model}} live", "max by (model) (tokenbus_model_workers)"),
            ("{{model}} recommended", "max by (model) (tokenbus_recommended_workers)"),
        ],
    ),
    (
        "Consumer lag",
        "Records behind the end, per consumer and topic (summed over partitions).",
        "short",
        [
            (
                "{{consumer}} {{topic}}",
                "sum by (consumer, topic) (tokenbus_consumer_lag_records)",
            )
        ],
    ),
    (
        "Billing lag",
        "Now minus the newest created_at stored in ClickHouse.",
        "s",
        [("billing", "max(tokenbus_billing_lag_seconds)")],
    ),
    (
        "Dead letters",
        "Records the job and the billing sink sent to the dead-letter topic.",
        "short",
        [
            ("job", "sum(rate(tokenbus_job_num_dead_letters_total[5m]))"),
            ("billing", "sum(rate(tokenbus_billing_dead_letters_total[5m]))"),
        ],
    ),
    (
        "Active SSE streams",
        "Streams the bridges hold open now.",
        "short",
        [("streams", "sum(tokenbus_bridge_active_streams)")],
    ),
]


def operations_dashboard() -> dict[str, Any]:
    return dashboard(
        title="tokenbus operations",
        uid="tokenbus-operations",
        description="The fleet from every service's /metrics (README.md, Metrics).",
        tag="operations",
        since="now-1h",
        refresh="10s",
        datasource=("Prometheus", DATASOURCE["type"]),
        variables=[],
        panels=[_panel(n, *panel) for n, panel in enumerate(PANELS)],
    )


def _panel(
    n: int, title: str, description: str, unit: str, targets: list[tuple[str, str]]
) -> dict[str, Any]:
    return {
        "id": n + 1,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (n % 2), "y": 8 * (n // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def render() -> str:
    return json.dumps(operations_dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
