"""The shared metrics vocabulary (tokenbus.metrics): bounded tenant labels, consumer lag."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenbus.config import Settings
from tokenbus.metrics import (
    ITL_BUCKETS,
    OTHER,
    TTFT_BUCKETS,
    ConsumerLagCollector,
    PartitionOffsets,
    TenantLabels,
    aiokafka_offsets,
    create_tenant_labels,
    drop_tenant_series,
    partition_lag,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_top_n_keep_their_names_and_the_rest_are_other() -> None:
    labels = TenantLabels(2, clock=Clock())
    for _ in range(5):
        assert labels.label("acme") == "acme"
        assert labels.label("beta") == "beta"

    assert labels.label("gamma") == OTHER
    assert labels.label("acme") == "acme"
    assert labels.current() == {"acme", "beta", OTHER}


def test_a_tenant_flood_never_grows_the_label_set_past_n_plus_one() -> None:
    clock = Clock()
    labels = TenantLabels(3, clock=clock, max_tracked=50)
    seen: set[str] = set()
    evicted: list[str] = []
    labels.on_evict(evicted.append)
    for n in range(5000):
        clock.now += 0.01
        seen.add(labels.label(f"flood-{n}"))
        assert len(labels.current()) <= 4
    # One request each: none beats the first three by a request's worth, so no churn.
    assert seen == {"flood-0", "flood-1", "flood-2", OTHER}
    assert evicted == []
    assert len(labels._scores) <= 50


def test_under_churn_the_exposed_series_stay_at_n_plus_one() -> None:
    registry = CollectorRegistry()
    counter = Counter("requests", "", ["tenant"], registry=registry)
    clock = Clock()
    labels = TenantLabels(3, half_life_s=5, clock=clock, max_tracked=40)
    labels.on_evict(drop_tenant_series(counter))
    for n in range(3000):
        clock.now += 0.05
        tenant = f"t-{n // 20}"  # a new busy tenant every 20 requests, the old ones stop
        counter.labels(labels.label(tenant)).inc()
        assert len(labels.current()) <= 4
    tenants = {
        sample.labels["tenant"]
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name == "requests_total"
    }
    assert len(tenants) <= 4
    assert "t-149" in tenants and OTHER in tenants  # the newest busy tenant is named


def test_a_busy_newcomer_displaces_an_idle_tenant_as_its_traffic_decays() -> None:
    clock = Clock()
    labels = TenantLabels(1, half_life_s=60, clock=clock)
    evicted: list[str] = []
    labels.on_evict(evicted.append)
    for _ in range(10):
        labels.label("old")
    clock.now += 600  # ten half-lives: old's 10 requests now weigh about 0.01
    assert labels.label("new") == OTHER  # one request does not beat it by a request
    assert labels.label("new") == "new"
    assert evicted == ["old"]
    assert labels.label("old") == OTHER
    assert labels.current() == {"new", OTHER}


def test_scores_stay_finite_over_a_long_run() -> None:
    clock = Clock()
    labels = TenantLabels(2, half_life_s=1, clock=clock)
    for step in range(2000):
        clock.now += 1.0
        labels.label("steady")
        if step % 3 == 0:
            labels.label("bursty")
    assert labels.current() == {"steady", "bursty", OTHER}
    assert all(score < 1e300 for score in labels._scores.values())


def test_zero_names_every_tenant_other() -> None:
    labels = TenantLabels(0, clock=Clock())
    assert {labels.label(t) for t in ("a", "b", "c")} == {OTHER}


def test_the_policy_comes_from_settings() -> None:
    settings = Settings(metrics_top_tenants=5, metrics_tenant_half_life_s=30)
    labels = create_tenant_labels(
        settings.metrics_top_tenants, settings.metrics_tenant_half_life_s, Clock()
    )
    assert labels.top_n == 5
    assert Settings().metrics_top_tenants == 20


def test_an_evicted_tenant_loses_its_series() -> None:
    registry = CollectorRegistry()
    counter = Counter("requests", "", ["tenant", "model"], registry=registry)
    clock = Clock()
    labels = TenantLabels(1, half_life_s=1, clock=clock)
    labels.on_evict(drop_tenant_series(counter))
    counter.labels(labels.label("old"), "m").inc()
    clock.now += 100
    for _ in range(3):
        counter.labels(labels.label("new"), "m").inc()

    tenants = {
        sample.labels["tenant"]
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    assert tenants == {"new", OTHER}


def test_buckets_are_increasing() -> None:
    for buckets in (TTFT_BUCKETS, ITL_BUCKETS):
        assert list(buckets) == sorted(set(buckets))


def test_lag_is_end_minus_position_and_unknown_until_both_are_known() -> None:
    assert partition_lag(PartitionOffsets("t", 0, 10, 4)) == 6
    assert partition_lag(PartitionOffsets("t", 0, 3, 4)) == 0
    assert partition_lag(PartitionOffsets("t", 0, None, 4)) is None
    assert partition_lag(PartitionOffsets("t", 0, 10, None)) is None


def _lag_samples(collector: ConsumerLagCollector) -> dict[tuple[str, str, str], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        (s.labels["consumer"], s.labels["topic"], s.labels["partition"]): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


def test_the_collector_labels_each_consumer_topic_and_partition() -> None:
    collector = ConsumerLagCollector()
    collector.track(
        "usage",
        lambda: [PartitionOffsets("usage", 0, 10, 7), PartitionOffsets("usage", 1, None, 0)],
    )
    collector.track("requests", lambda: [PartitionOffsets("req", 2, 5, 5)])

    assert _lag_samples(collector) == {("usage", "usage", "0"): 3, ("requests", "req", "2"): 0}


def _state(position: int | None, highwater: int | None) -> Any:
    return SimpleNamespace(
        has_valid_position=position is not None, position=position, highwater=highwater
    )


def test_an_aiokafka_consumer_is_read_from_its_partition_states() -> None:
    states = {
        TopicPartition("a", 0): _state(4, 9),
        TopicPartition("a", 1): _state(None, 9),
        TopicPartition("b", 0): _state(1, 2),
    }
    consumer = SimpleNamespace(
        assignment=lambda: set(states),
        _subscription=SimpleNamespace(
            subscription=SimpleNamespace(assignment=SimpleNamespace(state_value=states.get))
        ),
    )
    read = aiokafka_offsets(lambda: consumer, ["a"])

    assert read() == [PartitionOffsets("a", 0, 9, 4), PartitionOffsets("a", 1, 9, None)]
    assert aiokafka_offsets(lambda: None)() == []
    broken = SimpleNamespace(assignment=lambda: {TopicPartition("a", 0)})
    assert aiokafka_offsets(lambda: broken)() == []  # not started: no partition state
