"""The job's metrics in Prometheus text format."""

from __future__ import annotations

from stream_jobs.dispatcher import DispatchMetrics

_COUNTERS = (
    "num_admitted",
    "num_rejected_quota",
    "num_rejected_budget",
    "num_budget_alerts",
    "num_rejected_invalid",
    "num_shed",
    "num_capped",
    "num_no_worker",
    "num_cancelled_waiting",
    "num_dead_letters",
    "num_dispatched",
    "num_duplicates",
    "num_tier_changes",
    "num_workers_lost",
    "num_redispatched",
    "num_resumed",
    "num_recovered_finished",
    "num_affine",
    "num_adapter_affine",
)
_GAUGES = ("tier", "tier_changed_at", "num_waiting", "num_in_flight", "capacity")


def _quantile(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render_metrics(metrics: DispatchMetrics) -> bytes:
    lines: list[str] = []
    for name in _COUNTERS:
        lines += [
            f"# TYPE tokenbus_job_{name}_total counter",
            f"tokenbus_job_{name}_total {getattr(metrics, name)}",
        ]
    for name in _GAUGES:
        lines += [
            f"# TYPE tokenbus_job_{name} gauge",
            f"tokenbus_job_{name} {getattr(metrics, name)}",
        ]
    lines.append("# TYPE tokenbus_job_queue_ms summary")
    for priority, samples in metrics.queue_ms_by_class.items():
        for q in (0.5, 0.99):
            lines.append(
                f'tokenbus_job_queue_ms{{priority="{priority}",quantile="{q}"}} '
                f"{_quantile(samples, q):.3f}"
            )
    lines.append("# TYPE tokenbus_job_intake_lag_ms summary")
    for stream, samples in sorted(metrics.lag_ms.items()):
        for q in (0.5, 0.99):
            lines.append(
                f'tokenbus_job_intake_lag_ms{{stream="{stream}",quantile="{q}"}} '
                f"{_quantile(samples, q):.3f}"
            )
    lines += [
        "# TYPE tokenbus_job_worker_kv_cache_usage gauge",
        "# TYPE tokenbus_job_worker_num_running gauge",
        "# TYPE tokenbus_job_worker_num_waiting gauge",
        "# TYPE tokenbus_job_worker_tokens_per_s gauge",
        "# TYPE tokenbus_job_worker_adapter_loads counter",
        "# TYPE tokenbus_job_worker_last_adapter_load_ms gauge",
        "# TYPE tokenbus_job_worker_adapter_held gauge",
    ]
    for worker_id, status in sorted(metrics.workers.items()):
        label = f'{{worker_id="{worker_id}",model="{status.model}"}}'
        lines += [
            f"tokenbus_job_worker_kv_cache_usage{label} {status.kv_cache_usage:.4f}",
            f"tokenbus_job_worker_num_running{label} {status.num_running}",
            f"tokenbus_job_worker_num_waiting{label} {status.num_waiting}",
            f"tokenbus_job_worker_tokens_per_s{label} {status.tokens_per_s:.1f}",
        ]
        if status.max_loras:
            lines.append(f"tokenbus_job_worker_adapter_loads{label} {status.num_adapter_loads}")
            if status.last_adapter_load_ms is not None:
                lines.append(
                    f"tokenbus_job_worker_last_adapter_load_ms{label} "
                    f"{status.last_adapter_load_ms:.3f}"
                )
        for adapter in sorted(status.adapters):
            lines.append(
                f'tokenbus_job_worker_adapter_held{{worker_id="{worker_id}",'
                f'model="{status.model}",adapter="{adapter}"}} 1'
            )
    return ("\n".join(lines) + "\n").encode()


def render_budget_metrics(rows: list[dict[str, object]]) -> bytes:
    """Spend, reservations and what is left of each budget this period, in cost units."""
    lines: list[str] = []
    for name in ("limit", "spent", "reserved", "remaining"):
        lines.append(f"# TYPE tokenbus_job_budget_{name}_units gauge")
        for row in rows:
            lines.append(
                f'tokenbus_job_budget_{name}_units{{budget="{row["budget_id"]}",'
                f'entity="{row["entity"]}",enforce="{row["enforce"]}",'
                f'period="{row["period"]}"}} {row[name]}'
            )
    return ("\n".join(lines) + "\n").encode() if rows else b""
