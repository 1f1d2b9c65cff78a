"""The job's metrics, rendered by ``prometheus_client`` from the dispatcher's counts.

# DispatchMetrics (the dispatcher's plain counts) + budget rows --> JobCollector
# the queue by (model, class) + heartbeats --> queue depth, waiting and running per model
#   --> stream_jobs.scaling --> tokenbus_recommended_workers{model}
# the Faust consumer's request-topic partitions --> ConsumerLagCollector
# the Faust consumer's assignment, and what its fetches ask for --> FetchedPartitions
# the tables' changelog records (stream_jobs.changelog) --> ChangelogRecords
# --> a registry of the job's own --> Prometheus text format at /metrics

The dispatcher keeps plain numbers (no I/O, no library in its hot path); a collector
reads them at scrape time, as the bridge's registry does for its own. Labels follow the
shared vocabulary (tokenbus.metrics): ``model``, ``priority``, ``worker``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stream_jobs.dispatcher import DispatchMetrics
from stream_jobs.scaling import ScalingPolicy
from tokenbus.metrics import (
    MODEL,
    PRIORITY,
    WORKER,
    ConsumerLagCollector,
    OffsetsSource,
    PartitionOffsets,
    aiokafka_offsets,
)

_COUNTERS = {
    "num_admitted": "requests admitted",
    "num_rejected_quota": "requests refused by the TPM/RPM window",
    "num_rejected_budget": "requests refused by a spend budget",
    "num_budget_alerts": "budget alerts published",
    "num_rejected_invalid": "requests refused by the tenant's rules",
    "num_unauthenticated": "requests refused for their credential",
    "num_forbidden": "requests whose credential may not do what they ask",
    "num_reply_topic_missing": "requests whose reply topic does not exist (dead-lettered)",
    "num_shed": "class 2 requests shed under overload",
    "num_capped": "requests whose max_tokens the overload tier capped",
    "num_no_worker": "requests answered no_worker",
    "num_cancelled_waiting": "requests cancelled while waiting",
    "num_dead_letters": "records sent to the dead-letter topic",
    "num_dispatched": "requests forwarded to a worker",
    "num_forward_retries": "forwards the broker did not take (the request waits again)",
    "num_duplicates": "copies of a request id that already had its run",
    "num_tier_changes": "overload tier changes",
    "num_workers_lost": "worker runs declared lost",
    "num_redispatched": "requests sent again after a lost worker",
    "num_resumed": "streams resumed on another worker",
    "num_recovered_finished": "finished requests whose UsageEvent the job wrote on recovery",
    "num_superseded": "attempts sent again, dropped as the attempt presumed lost finished",
    "num_adopted": "requests in flight adopted from an earlier run or another instance",
    "num_adoptions_failed": "forwarded requests whose copy could not be read back to adopt",
    "num_affine": "requests sent to their session's last worker",
    "num_adapter_affine": "adapter requests sent to a worker holding their adapter",
    "num_batch_admitted": "batch lines admitted by their tenant's batch budget",
    "num_batch_rejected_quota": "batch lines refused by their tenant's batch TPM/RPM window",
    "num_batch_rejected_invalid": "requests with a batch_id refused for not being class 2",
    "num_prompt_counts_vouched": "prompts counted by the bridge, vouched for on the record",
    "num_prompt_vouches_refused": "prompt counts on a record the job did not believe",
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
        *,
        waiting: Callable[[], Mapping[tuple[str, int], int]] = dict,
        scaling: ScalingPolicy | None = None,
        default_max_num_seqs: int = 64,
    ) -> None:
        self._metrics = metrics
        self._budget_rows = budget_rows
        self._waiting = waiting
        self._scaling = scaling or ScalingPolicy()
        self._default_max_num_seqs = default_max_num_seqs

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
        yield self._refusals(metrics)
        yield from self._workers(metrics)
        yield from self._models(metrics, self._waiting())
        yield from self._budgets()

    @staticmethod
    def _refusals(metrics: DispatchMetrics) -> Metric:
        family = CounterMetricFamily(
            "tokenbus_job_quota_refusals",
            "requests refused by a quota: the TPM/RPM window's reasons, a spend budget, "
            "the overload tier (shed)",
            labels=["reason"],
        )
        counts = {
            **metrics.quota_refusals,
            "budget": metrics.num_rejected_budget,
            "overloaded": metrics.num_shed,
        }
        for reason, count in sorted(counts.items()):
            family.add_metric([reason], count)
        return family

    def _models(
        self, metrics: DispatchMetrics, queued: Mapping[tuple[str, int], int]
    ) -> Iterator[Metric]:
        """The queue by model and class, and per model the scaling signals."""
        depth = GaugeMetricFamily(
            "tokenbus_job_queue_depth",
            "requests admitted and waiting in the job's queue for a seat",
            labels=[MODEL, PRIORITY],
        )
        for (model, priority), count in sorted(queued.items()):
            depth.add_metric([model, str(priority)], count)
        yield depth
        rows = model_load(metrics, queued)
        gauges = {
            field: GaugeMetricFamily(name, text, labels=[MODEL])
            for field, name, text in _MODEL_GAUGES
        }
        recommended = GaugeMetricFamily(
            "tokenbus_recommended_workers",
            "workers the model needs: ceil((running + waiting) / (max_num_seqs * "
            "target_utilisation)), within [min, max] (stream_jobs.scaling)",
            labels=[MODEL],
        )
        for model, load in sorted(rows.items()):
            seats = load.max_num_seqs or self._default_max_num_seqs
            for field, family in gauges.items():
                family.add_metric([model], getattr(load, field))
            recommended.add_metric(
                [model],
                self._scaling.recommended_workers(load.num_running, load.num_waiting, seats),
            )
        yield from (*gauges.values(), recommended)

    def _workers(self, metrics: DispatchMetrics) -> Iterator[Metric]:
        labels = [WORKER, MODEL]
        gauges = {
            field: GaugeMetricFamily(f"tokenbus_job_worker_{field}", text, labels=labels)
            for field, text in _WORKER_GAUGES
        }
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
            for field, family in gauges.items():
                family.add_metric(values, getattr(status, field))
            if status.max_loras:
                loads.add_metric(values, status.num_adapter_loads)
                if status.last_adapter_load_ms is not None:
                    load_ms.add_metric(values, status.last_adapter_load_ms)
            for adapter in sorted(status.adapters):
                held.add_metric([*values, adapter], 1)
        yield from (*gauges.values(), loads, load_ms, held)

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


_MODEL_GAUGES = (
    (
        "num_waiting",
        "tokenbus_model_requests_waiting",
        "requests waiting for a seat: in the job's queue and in the engines' queues",
    ),
    ("num_running", "tokenbus_model_requests_running", "requests running in the engines"),
    ("num_workers", "tokenbus_model_workers", "live workers serving the model"),
)
"""A model's load (``ModelLoad``) fields the job exposes as they are: (field, metric, help)."""

_WORKER_GAUGES = (
    ("kv_cache_usage", "KV cache in use (0-1)"),
    ("num_running", "requests running"),
    ("num_waiting", "requests waiting in vLLM"),
    ("tokens_per_s", "tokens generated per second"),
)
"""A worker's heartbeat fields the job exposes as they are: ``tokenbus_job_worker_<field>``."""


@dataclass
class ModelLoad:
    num_waiting: int = 0
    num_running: int = 0
    num_workers: int = 0
    max_num_seqs: int = 0
    """The seats of one of the model's workers (the largest a live one reports)."""


def model_load(
    metrics: DispatchMetrics, queued: Mapping[tuple[str, int], int]
) -> dict[str, ModelLoad]:
    """Per model: waiting (the job's queue + the engines' queues), running, live workers."""
    rows: dict[str, ModelLoad] = {}
    for (model, _), count in queued.items():
        rows.setdefault(model, ModelLoad()).num_waiting += count
    for status in metrics.workers.values():
        if status.draining:
            continue
        load = rows.setdefault(status.model, ModelLoad())
        load.num_waiting += status.num_waiting
        load.num_running += status.num_running
        load.num_workers += 1
        load.max_num_seqs = max(load.max_num_seqs, status.max_num_seqs)
    return rows


def aiokafka_under(app: Any) -> Any:
    """The aiokafka consumer under the Faust app's consumer thread; None before it starts."""
    return getattr(getattr(getattr(app, "consumer", None), "_thread", None), "_consumer", None)


def faust_offsets(app: Any, topics: Iterable[str]) -> OffsetsSource:
    """The Faust consumer's partitions of ``topics``: the high-water mark its fetches
    saw, and the offset after the last record it read into a stream (before the first,
    the fetch position of the aiokafka consumer under it)."""
    wanted = set(topics)
    fetched = aiokafka_offsets(lambda: aiokafka_under(app), wanted)

    def read() -> list[PartitionOffsets]:
        try:
            consumer = app.consumer
            assignment = consumer.assignment()
            read_offsets = consumer._read_offset  # Faust's own record of what it read
        except Exception:  # not started, or between assignments
            return []
        below = {(o.topic, o.partition): o for o in fetched()}
        rows = []
        for tp in sorted(assignment):
            if tp.topic not in wanted:
                continue
            fallback = below.get((tp.topic, tp.partition))
            try:
                end = consumer.highwater(tp)
            except Exception:
                end = None
            if end is None and fallback is not None:
                end = fallback.end
            last = read_offsets.get(tp)
            position = last + 1 if last is not None else fallback and fallback.position
            rows.append(PartitionOffsets(tp.topic, tp.partition, end, position))
        return rows

    return read


class FetchedPartitions(Collector):
    """``tokenbus_job_partitions{role, fetched}``: the partitions this instance holds, by
    role (``stream``: what its agents read; ``changelog``: its tables'), and whether its
    fetches ask the broker for them (``false``: paused in aiokafka's fetcher, as a
    recovered table's changelog is, stream_jobs.faust_pauses). Read at scrape time."""

    def __init__(self, partitions: Callable[[], Iterable[tuple[str, bool]]]) -> None:
        self._partitions = partitions
        """Each assigned partition as (role, fetched)."""

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "tokenbus_job_partitions",
            "Partitions this job instance holds, by role, and whether its fetches ask for them",
            labels=["role", "fetched"],
        )
        counts = Counter(self._partitions())
        for role in ("stream", "changelog"):
            for fetched in (True, False):
                family.add_metric([role, str(fetched).lower()], counts.get((role, fetched), 0))
        yield family


def faust_partitions(app: Any) -> Callable[[], list[tuple[str, bool]]]:
    """The Faust consumer's assigned partitions as (role, fetched): a changelog of one
    of its tables or a stream, and not paused in the aiokafka consumer under it."""

    def read() -> list[tuple[str, bool]]:
        inner = aiokafka_under(app)
        try:
            assignment = inner.assignment()
            paused = inner.paused()
            changelogs = app.tables.changelog_topics
        except Exception:  # not started, or between assignments
            return []
        return [
            ("changelog" if tp.topic in changelogs else "stream", tp not in paused)
            for tp in assignment
        ]

    return read


class ChangelogRecords(Collector):
    """The job's table writes (``stream_jobs.changelog``): records the broker holds, and
    records that never reached it (each also logged, with its topic and partition)."""

    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        num_sent, num_failed = self._counts()
        yield CounterMetricFamily(
            "tokenbus_job_changelog_records_sent",
            "table changelog records the broker acknowledged",
            value=num_sent,
        )
        yield CounterMetricFamily(
            "tokenbus_job_changelog_records_failed",
            "table changelog records that did not reach the broker",
            value=num_failed,
        )


def job_registry(
    metrics: Callable[[], DispatchMetrics],
    budget_rows: Callable[[], list[dict[str, object]]] = list,
    *,
    waiting: Callable[[], Mapping[tuple[str, int], int]] = dict,
    lag: OffsetsSource | None = None,
    partitions: Callable[[], Iterable[tuple[str, bool]]] | None = None,
    changelog: Callable[[], tuple[int, int]] | None = None,
    scaling: ScalingPolicy | None = None,
    default_max_num_seqs: int = 64,
) -> CollectorRegistry:
    """A registry of the job's own (not the process-wide default)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        JobCollector(
            metrics,
            budget_rows,
            waiting=waiting,
            scaling=scaling,
            default_max_num_seqs=default_max_num_seqs,
        )
    )
    consumer_lag = ConsumerLagCollector()
    if lag is not None:
        consumer_lag.track("job", lag)
    registry.register(consumer_lag)
    if partitions is not None:
        registry.register(FetchedPartitions(partitions))
    if changelog is not None:
        registry.register(ChangelogRecords(changelog))
    return registry
