"""The topics tokenbus creates with more than the broker's defaults, and drift from them."""

from __future__ import annotations

from tokenbus.config import Settings
from tokenbus.kafka import planned_configs
from tokenbus.topics import ConfigDrift, Topics, config_drift, topic_configs
from tokenbus_cli.stack import stack_topics


def test_budgets_are_compacted_and_live_topics_expire() -> None:
    topics = Topics("t")
    configs = topic_configs(topics, live_retention_ms=120_000)
    assert configs[topics.budgets] == {"cleanup.policy": "compact"}
    for live in (topics.heartbeats, topics.load):
        assert configs[live] == {"retention.ms": "120000", "segment.ms": "120000"}
    # The request path's topics keep the broker's retention: a forward is looked up in
    # its worker's topic, usage waits there until billing has it.
    assert not {*topics.all_requests, topics.usage, topics.cancels} & configs.keys()


def test_every_planned_topic_is_one_the_stack_creates() -> None:
    settings = Settings(topic_prefix="p", live_topic_retention_ms=60_000)
    planned = planned_configs(settings)
    assert planned.keys() <= stack_topics(settings).keys()
    assert planned[Topics("p").heartbeats]["retention.ms"] == "60000"


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
