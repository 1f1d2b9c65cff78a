"""The job's /metrics (stream_jobs.metrics): prometheus_client's text, from the
dispatcher's plain counts, read back with prometheus_client's own parser."""

from __future__ import annotations

from types import SimpleNamespace

from faust.types import TP
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from schemas import WorkerStatus
from stream_jobs.dispatcher import DispatchMetrics
from stream_jobs.metrics import faust_offsets, faust_partitions, job_registry
from stream_jobs.scaling import ScalingPolicy
from tokenbus.metrics import PartitionOffsets


def render_metrics(
    metrics: DispatchMetrics, budget_rows: list[dict[str, object]] | None = None
) -> bytes:
    """What the job's /metrics serves for these counts and budget rows."""
    return generate_latest(job_registry(lambda: metrics, lambda: budget_rows or []))


def samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_counts_gauges_and_summaries_render_with_their_types() -> None:
    metrics = DispatchMetrics(num_admitted=7, num_unauthenticated=2, num_forbidden=1, tier=1)
    metrics.queue_ms_by_class[0] = [1.0, 2.0, 30.0]
    text = render_metrics(metrics)
    got = samples(text)
    assert got[("tokenbus_job_num_admitted_total", frozenset())] == 7
    assert got[("tokenbus_job_num_unauthenticated_total", frozenset())] == 2
    assert got[("tokenbus_job_num_forbidden_total", frozenset())] == 1
    assert got[("tokenbus_job_tier", frozenset())] == 1
    p99 = frozenset({("priority", "0"), ("quantile", "0.99")})
    assert got[("tokenbus_job_queue_ms", p99)] == 30.0
    assert b"# TYPE tokenbus_job_queue_ms summary" in text


def test_each_worker_and_the_adapters_it_holds() -> None:
    metrics = DispatchMetrics()
    metrics.workers["w1"] = WorkerStatus(
        worker_id="w1",
        model="tiny",
        request_topic="tokenbus.worker.w1",
        num_running=3,
        kv_cache_usage=0.25,
        max_loras=2,
        adapters=["a1"],
        num_adapter_loads=4,
    )
    got = samples(render_metrics(metrics))
    worker = frozenset({("worker", "w1"), ("model", "tiny")})
    assert got[("tokenbus_job_worker_num_running", worker)] == 3
    assert got[("tokenbus_job_worker_kv_cache_usage", worker)] == 0.25
    assert got[("tokenbus_job_worker_adapter_loads_total", worker)] == 4
    assert got[("tokenbus_job_worker_adapter_held", worker | {("adapter", "a1")})] == 1


def test_budgets_show_their_spend_and_what_is_left() -> None:
    row: dict[str, object] = {
        "budget_id": "tenant:acme|month@UTC",
        "entity": "tenant:acme",
        "enforce": "hard",
        "period": "month",
        "limit": "10.5",
        "spent": "4",
        "reserved": "0.5",
        "remaining": "6",
    }
    got = samples(render_metrics(DispatchMetrics(), [row]))
    labels = frozenset(
        {
            ("budget", "tenant:acme|month@UTC"),
            ("entity", "tenant:acme"),
            ("enforce", "hard"),
            ("period", "month"),
        }
    )
    assert got[("tokenbus_job_budget_remaining_units", labels)] == 6.0
    assert got[("tokenbus_job_budget_limit_units", labels)] == 10.5


def test_queue_depth_and_the_scaling_signals_per_model() -> None:
    metrics = DispatchMetrics()
    metrics.workers["w1"] = WorkerStatus(
        worker_id="w1",
        model="tiny",
        request_topic="tokenbus.worker.w1",
        num_running=8,
        num_waiting=2,
        max_num_seqs=8,
    )
    queued = {("tiny", 1): 5, ("tiny", 2): 1, ("big", 0): 3}
    registry = job_registry(
        lambda: metrics,
        waiting=lambda: queued,
        scaling=ScalingPolicy(target_utilisation=0.5, min_workers=1, max_workers=10),
        default_max_num_seqs=4,
    )
    got = samples(generate_latest(registry))

    depth = frozenset({("model", "tiny"), ("priority", "1")})
    assert got[("tokenbus_job_queue_depth", depth)] == 5
    tiny, big = frozenset({("model", "tiny")}), frozenset({("model", "big")})
    assert got[("tokenbus_model_requests_waiting", tiny)] == 8  # 6 in the queue, 2 in vLLM
    assert got[("tokenbus_model_requests_running", tiny)] == 8
    assert got[("tokenbus_model_workers", tiny)] == 1
    # ceil((8 + 8) / (8 * 0.5)) = 4; big has no worker: the setting's 4 seats, ceil(3 / 2)
    assert got[("tokenbus_recommended_workers", tiny)] == 4
    assert got[("tokenbus_recommended_workers", big)] == 2
    assert got[("tokenbus_model_workers", big)] == 0


def test_quota_refusals_by_reason() -> None:
    metrics = DispatchMetrics(num_rejected_budget=2, num_shed=1)
    for reason in ("tpm", "tpm", "rpm", "needs 900 tokens, more than the 100 per minute"):
        metrics.note_quota_refusal(reason)
    metrics.note_quota_refusal("tpm_burst: at most 40 tokens in any 10 s (...)")
    got = samples(render_metrics(metrics))

    def refusals(reason: str) -> float:
        return got[("tokenbus_job_quota_refusals_total", frozenset({("reason", reason)}))]

    assert refusals("tpm") == 2
    assert refusals("rpm") == 1
    assert refusals("too_large") == 1
    assert refusals("tpm_burst") == 1
    assert refusals("budget") == 2
    assert refusals("overloaded") == 1


def test_request_topic_lag_from_the_faust_consumer() -> None:
    tps = [TP("tokenbus.requests.p0", 0), TP("tokenbus.requests.p0", 1), TP("other", 0)]
    consumer = SimpleNamespace(
        assignment=lambda: set(tps),
        highwater={tps[0]: 10, tps[1]: 3, tps[2]: 50}.__getitem__,
        _read_offset={tps[0]: 6, tps[2]: 1},
    )
    app = SimpleNamespace(consumer=consumer)
    read = faust_offsets(app, ["tokenbus.requests.p0"])

    assert read() == [
        PartitionOffsets("tokenbus.requests.p0", 0, 10, 7),
        PartitionOffsets("tokenbus.requests.p0", 1, 3, None),
    ]
    got = samples(generate_latest(job_registry(DispatchMetrics, lag=read)))
    lag = frozenset({("consumer", "job"), ("topic", "tokenbus.requests.p0"), ("partition", "0")})
    assert got[("tokenbus_consumer_lag_records", lag)] == 3
    assert faust_offsets(SimpleNamespace(), ["x"])() == []  # no consumer yet


def test_partitions_held_by_role_and_whether_they_are_fetched() -> None:
    ledger, spend = "tokenbus-dispatch-request-ledger-changelog", "tokenbus-budget-changelog"
    tps = [TP("tokenbus.usage", 0), TP("tokenbus.usage", 1), TP(ledger, 0), TP(spend, 0)]
    inner = SimpleNamespace(assignment=lambda: set(tps), paused=lambda: {tps[2], tps[3]})
    app = SimpleNamespace(
        consumer=SimpleNamespace(_thread=SimpleNamespace(_consumer=inner)),
        tables=SimpleNamespace(changelog_topics={ledger, spend}),
    )
    got = samples(generate_latest(job_registry(DispatchMetrics, partitions=faust_partitions(app))))

    def count(role: str, fetched: str) -> float:
        return got[("tokenbus_job_partitions", frozenset({("role", role), ("fetched", fetched)}))]

    assert (count("stream", "true"), count("stream", "false")) == (2, 0)
    assert (count("changelog", "true"), count("changelog", "false")) == (0, 2)
    inner.paused = lambda: {tps[1]}  # a stream paused, a changelog fetched: told apart
    got = samples(generate_latest(job_registry(DispatchMetrics, partitions=faust_partitions(app))))
    assert (count("stream", "false"), count("changelog", "true")) == (1, 2)
    assert faust_partitions(SimpleNamespace())() == []  # no consumer yet
