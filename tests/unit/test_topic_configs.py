"""The topics tokenbus creates with more than the broker's defaults, and drift from them."""

from __future__ import annotations

from tokenbus.config import Settings
from tokenbus.kafka import topic_plan
from tokenbus.topics import ConfigDrift, TopicPlan, Topics, config_drift, replication_advice
from tokenbus_cli.stack import stack_topics

PLAN = TopicPlan(
    Topics("t"),
    live_retention_ms=120_000,
    batch_retention_ms=900_000,
    content_retention_ms=5_000_000,
)
CONTENT = {"retention.ms": "5000000", "segment.ms": "5000000"}


def test_budgets_are_compacted_and_live_topics_expire() -> None:
    topics = PLAN.topics
    assert PLAN.configs(topics.budgets) == {"cleanup.policy": "compact"}
    for live in (topics.heartbeats, topics.load):
        assert PLAN.configs(live) == {"retention.ms": "120000", "segment.ms": "120000"}
    # Usage waits until billing has it, spans until their sink does, dead letters until
    # an operator looks: the broker's retention.
    for plain in (topics.usage, topics.cancels, topics.spans, topics.dead_letters):
        assert PLAN.configs(plain) is None, plain


def test_prompts_and_answers_are_kept_for_the_content_retention() -> None:
    topics = PLAN.topics
    for content in (
        *topics.all_requests,
        topics.worker("gpu-0"),
        topics.replies("bridge-01abc"),
        topics.replies("acme.client-1"),
        topics.replies("acme.client-1") + ".3",  # a rolled one
    ):
        assert PLAN.configs(content) == CONTENT, content
    assert PLAN.configs(topics.worker("")) is None  # no worker's: not a worker topic


def test_a_batch_and_its_reply_topic_outlive_the_batch() -> None:
    topics = PLAN.topics
    batch = {"retention.ms": "900000", "segment.ms": "900000"}
    assert PLAN.configs(topics.batches) == batch
    assert PLAN.configs(topics.batch_replies("acme-1", "batch_0123456789ab")) == batch
    # Not a batch's: a client's reply topic, one named like a batch's but not one, a
    # batch reply topic's roll (the bundled broker's only) and another prefix's.
    for other in (
        topics.replies("bridge-abc"),
        topics.replies("acme.batch-nope"),
        topics.batch_replies("acme", "batch_0123456789ab") + ".1",
    ):
        assert PLAN.configs(other) == CONTENT, other
    assert PLAN.configs(Topics("u").batch_replies("acme", "batch_0123456789ab")) is None


def test_the_settings_give_a_batch_a_day_beyond_the_longest_window() -> None:
    settings = Settings(topic_prefix="p", live_topic_retention_ms=60_000, batch_max_window_s=3600)
    plan = topic_plan(settings)
    assert plan.named().keys() <= stack_topics(settings).keys()
    assert plan.configs(Topics("p").heartbeats) == {"retention.ms": "60000", "segment.ms": "60000"}
    assert plan.batch_retention_ms == (3600 + 86_400) * 1000
    assert plan.content_retention_ms == 86_400_000


def test_drift_names_each_missing_or_different_config() -> None:
    want = {
        "b": {"cleanup.policy": "compact"},
        "h": {"retention.ms": "1000", "segment.ms": "1000"},
        "new": {"retention.ms": "1000"},
    }
    have = {"b": {}, "h": {"retention.ms": "1000", "segment.ms": "604800000"}, "other": {}}
    assert config_drift(want, have) == [
        ConfigDrift("b", "cleanup.policy", "compact", None),
        ConfigDrift("h", "segment.ms", "1000", "604800000"),
    ]


def test_no_drift_where_the_configs_match() -> None:
    want = {"b": {"cleanup.policy": "compact"}}
    assert config_drift(want, {"b": {"cleanup.policy": "compact", "x": "y"}}) == []


def test_replication_below_what_the_cluster_allows_is_called_out() -> None:
    assert replication_advice(1, 1) is None  # the bundled broker: one copy is all
    assert replication_advice(3, 5) is None
    assert replication_advice(2, 2) is None
    advice = replication_advice(1, 3)
    assert advice is not None
    assert "replication factor 1 on a cluster of 3 brokers" in advice
    assert "TOKENBUS_REPLICATION_FACTOR=3" in advice and "min.insync.replicas=2" in advice
    assert "TOKENBUS_REPLICATION_FACTOR=2" in (replication_advice(1, 2) or "")
