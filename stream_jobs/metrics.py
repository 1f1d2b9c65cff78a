"""The job's metrics, rendered by ``prometheus_client`` from the dispatcher's counts.

# DispatchMetrics (the dispatcher's plain counts) + budget rows --> JobCollector
# --> a registry of the job's own --> Prometheus text format at /metrics

The dispatcher keeps plain numbers (no I/O, no library in its hot path); a collector
reads them at scrape time, as the bridge's registry does for its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stream_jobs.dispatcher import DispatchMetrics

_COUNTERS = {
    "num_admitted": "requests admitted",
    "num_rejected_quota": "requests refused by the TPM/RPM window",
    "num_rejected_budget": "requests refused by a spend budget",
    "num_budget_alerts": "budget alerts published",
    "num_rejected_invalid": "requests refused by the tenant's rules",
    "num_unauthenticated": "requests refused for their credential",
    "num_forbidden": "requests whose credential may not do what they ask",
    "num_shed": "class 2 requests shed under overload",
    "num_capped": "requests whose max_tokens the overload tier capped",
    "num_no_worker": "requests answered no_worker",
    "num_cancelled_waiting": "requests cancelled while waiting",
    "num_dead_letters": "records sent to the dead-letter topic",
    "num_dispatched": "requests forwarded to a worker",
    "num_duplicates": "copies of a request id that already had its run",
    "num_tier_changes": "overload tier changes",
    "num_workers_lost": "worker runs declared lost",
    "num_redispatched": "requests sent again after a lost worker",
    "num_resumed": "streams resumed on another worker",
    "num_recovered_finished": "finished requests whose UsageEvent the job wrote on recovery",
    "num_affine": "requests sent to their session's last worker",
    "num_adapter_affine": "adapter requests sent to a worker holding their adapter",
    "num_batch_admitted": "batch lines admitted by their tenant's batch budget",
    "num_batch_rejected_quota": "batch lines refused by their tenant's batch TPM/RPM window",
    "num_batch_rejected_invalid": "requests with a batch_id refused for not being class 2",
}
_GAUGES = {
    "tier": "overload tier: 0 normal, 1 capped, 2 shedding",
    "tier_changed_at": "when the tier last changed (unix seconds)",
    "num_waiting": "requests waiting for a seat",
    "num_in_flight": "requests forwarded and not yet reported",
    "capacity": "the live fleet's seats",
}
_QUANTILES = (0.5, 0.99)


def _quantile(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(name: str, documentation: str, label: str, series: dict[Any, list[float]]) -> Metric:
    """Quantiles over the last samples kept per series (the dispatcher keeps 1,000)."""
    family = Metric(name, documentation, "summary")
    for value, samples in sorted(series.items()):
        for q in _QUANTILES:
            family.add_sample(
                name, {label: str(value), "quantile": str(q)}, round(_quantile(samples, q), 3)
            )
    return family


class JobCollector(Collector):
    def __init__(
        self,
        metrics: Callable[[], DispatchMetrics],
        budget_rows: Callable[[], list[dict[str, object]]] = list,
    ) -> None:
        self._metrics = metrics
        self._budget_rows = budget_rows

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics()
        for name, documentation in _COUNTERS.items():
            yield CounterMetricFamily(
                f"tokenbus_job_{name}", documentation, value=getattr(metrics, name)
            )
        for name, documentation in _GAUGES.items():
            yield GaugeMetricFamily(
                f"tokenbus_job_{name}", documentation, value=getattr(metrics, name)
            )
        yield _summary(
            "tokenbus_job_queue_ms",
            "time from admission to forward, by class (ms)",
            "priority",
            metrics.queue_ms_by_class,
        )
        yield _summary(
            "tokenbus_job_intake_lag_ms",
            "how stale an input is when the job acts on it (ms)",
            "stream",
            metrics.lag_ms,
        )
        yield from self._workers(metrics)
        yield from self._budgets()

    def _workers(self, metrics: DispatchMetrics) -> Iterator[Metric]:
        labels = ["worker_id", "model"]
        kv = GaugeMetricFamily(
            "tokenbus_job_worker_kv_cache_usage", "KV cache in use (0-1)", labels=labels
        )
        running = GaugeMetricFamily(
            "tokenbus_job_worker_num_running", "requests running", labels=labels
        )
        waiting = GaugeMetricFamily(
            "tokenbus_job_worker_num_waiting", "requests waiting in vLLM", labels=labels
        )
        rate = GaugeMetricFamily(
            "tokenbus_job_worker_tokens_per_s", "tokens generated per second", labels=labels
        )
        loads = CounterMetricFamily(
            "tokenbus_job_worker_adapter_loads", "LoRA adapter loads", labels=labels
        )
        load_ms = GaugeMetricFamily(
            "tokenbus_job_worker_last_adapter_load_ms", "the last adapter load (ms)", labels=labels
        )
        held = GaugeMetricFamily(
            "tokenbus_job_worker_adapter_held",
            "1 for each adapter a worker holds",
            labels=[*labels, "adapter"],
        )
        for worker_id, status in sorted(metrics.workers.items()):
            values = [worker_id, status.model]
            kv.add_metric(values, status.kv_cache_usage)
            running.add_metric(values, status.num_running)
            waiting.add_metric(values, status.num_waiting)
            rate.add_metric(values, status.tokens_per_s)
            if status.max_loras:
                loads.add_metric(values, status.num_adapter_loads)
                if status.last_adapter_load_ms is not None:
                    load_ms.add_metric(values, status.last_adapter_load_ms)
            for adapter in sorted(status.adapters):
                held.add_metric([*values, adapter], 1)
        yield from (kv, running, waiting, rate, loads, load_ms, held)

    def _budgets(self) -> Iterator[Metric]:
        """Spend, reservations and what is left of each budget this period, in cost units."""
        rows = self._budget_rows()
        labels = ["budget", "entity", "enforce", "period"]
        for name in ("limit", "spent", "reserved", "remaining"):
            family = GaugeMetricFamily(
                f"tokenbus_job_budget_{name}_units", f"budget {name}, in cost units", labels=labels
            )
            for row in rows:
                values = [str(row[key]) for key in ("budget_id", "entity", "enforce", "period")]
                family.add_metric(values, float(str(row[name])))
            yield family


def job_registry(
    metrics: Callable[[], DispatchMetrics],
    budget_rows: Callable[[], list[dict[str, object]]] = list,
) -> CollectorRegistry:
    """A registry of the job's own (not the process-wide default)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(metrics, budget_rows))
    return registry
