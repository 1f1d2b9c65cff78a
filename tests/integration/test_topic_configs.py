"""tokenbus's topics carry their planned configs on the stack's broker, and ``tokenbus
topics`` says when an existing topic's do not."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from click.testing import CliRunner

from producers import TokenbusClient
from tokenbus.config import Settings
from tokenbus.kafka import delete_topics, topic_configs_of, topic_names
from tokenbus.topics import Topics
from tokenbus_cli import cli
from tokenbus_cli.stack import stack_topics


async def test_the_stack_compacts_budgets_and_expires_heartbeats(settings: Settings) -> None:
    topics = Topics(settings.topic_prefix)
    names = [topics.budgets, topics.heartbeats, topics.load, topics.batches, topics.usage]
    configs = await topic_configs_of(settings, names)
    assert configs[topics.budgets].get("cleanup.policy") == "compact"
    retention = str(settings.live_topic_retention_ms)
    for live in (topics.heartbeats, topics.load):
        assert configs[live].get("retention.ms") == retention, configs[live]
        assert configs[live].get("segment.ms") == retention, configs[live]
    batches = configs[topics.batches]
    assert batches.get("retention.ms") == str(settings.batch_topic_retention_ms), batches
    assert "retention.ms" not in configs[topics.usage]  # the broker's default


async def test_prompts_and_answers_keep_the_content_retention(
    settings: Settings, client: TokenbusClient
) -> None:
    topics = Topics(settings.topic_prefix)
    workers = [t for t in await topic_names(settings) if topics.is_worker_topic(t)]
    assert workers, "the stack's worker made no topic"
    names = [*topics.all_requests, *workers, client.reply_topic]
    configs = await topic_configs_of(settings, names)
    for name in names:
        assert configs[name].get("retention.ms") == str(settings.content_topic_retention_ms), (
            name,
            configs[name],
        )


async def test_a_batch_reply_topic_outlives_the_longest_batch(settings: Settings) -> None:
    # As the batch runner makes it (batches.run): the batch's client creates its topic.
    batch_id = f"batch_{uuid.uuid4().hex[:12]}"
    client = TokenbusClient(settings, f"batch-{batch_id}", tenant_id="acme", reply_reader=False)
    await client.start()
    try:
        topic = client.reply_topic
        assert topic == Topics(settings.topic_prefix).batch_replies("acme", batch_id)
        configs = (await topic_configs_of(settings, [topic]))[topic]
    finally:
        await client.close()
        await delete_topics(settings, [topic])
    window_ms = settings.batch_max_window_s * 1000
    assert int(configs["retention.ms"]) == settings.batch_topic_retention_ms > window_ms


async def _create_plain(settings: Settings, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 1, settings.replication_factor)])
    finally:
        await admin.close()


def test_topics_check_fails_on_a_budgets_topic_made_without_compaction(
    settings: Settings, tmp_path: Path
) -> None:
    # A cluster whose budgets topic predates the plan: under another prefix, so the
    # stack's own topics are untouched.
    ours = settings.model_copy(update={"topic_prefix": f"drift{uuid.uuid4().hex[:8]}"})
    topics = Topics(ours.topic_prefix)
    asyncio.run(_create_plain(ours, topics.budgets))
    env = {
        "TOKENBUS_HOME": str(tmp_path),
        "TOKENBUS_KAFKA_BOOTSTRAP": ours.bootstrap,
        "TOKENBUS_BROKER_PROFILE": "tansu",
        "TOKENBUS_TOPIC_PREFIX": ours.topic_prefix,
    }
    try:
        plain = CliRunner().invoke(cli.main, ["topics"], env=env)
        checked = CliRunner().invoke(cli.main, ["topics", "--check"], env=env)
        created = asyncio.run(topic_configs_of(ours, [topics.heartbeats]))
    finally:
        asyncio.run(delete_topics(ours, stack_topics(ours)))
    assert plain.exit_code == 0, plain.output
    assert checked.exit_code == 1, checked.output
    for result in (plain, checked):
        assert f"warning: {topics.budgets} existed before with cleanup.policy unset" in (
            result.output
        )
        assert "--add-config cleanup.policy=compact" in result.output
    # The topics it had to create got their configs; only the old one drifts.
    assert created[topics.heartbeats].get("retention.ms") == str(ours.live_topic_retention_ms)
    assert "heartbeats existed before" not in checked.output
    # One broker: one copy is all there can be, so no word on replication.
    assert "replication factor" not in checked.output
