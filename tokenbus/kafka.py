"""aiokafka producers, consumers and topic admin, built from Settings.

Every Kafka knob (bootstrap, acks, idempotence, linger, fetch wait) comes from
configuration, so the same code runs against the bundled broker and Apache Kafka. The
bundled broker's workarounds come in only with its profile (tokenbus.tansu).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError
from aiokafka.partitioner import DefaultPartitioner

from tokenbus import tansu
from tokenbus.config import Settings
from tokenbus.metadata import ProducerTopics
from tokenbus.topics import ConfigDrift, TopicPlan, Topics, config_drift


class Publish(Protocol):
    """Sends one record and returns once the broker has acknowledged it."""

    def __call__(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> Awaitable[Any]: ...


_murmur2 = DefaultPartitioner()


def partition_by_key(key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
    """Kafka's default partitioner (murmur2 of the key), except that a topic of one
    partition (every reply topic) skips the hash: aiokafka's is pure Python, and was
    6 to 7% of a worker's CPU with a record per step per reply topic and tenant."""
    if len(all_partitions) == 1:
        return all_partitions[0]
    return int(_murmur2(key, all_partitions, available))


@functools.lru_cache(maxsize=4096)
def key_partition(key: bytes, num_partitions: int) -> int:
    """The partition Kafka's default partitioner gives a record keyed ``key`` (murmur2,
    as the Java client, aiokafka and librdkafka's ``murmur2_random`` hash it). Cached:
    the keys are tenant ids, few, and the hash is pure Python."""
    every = list(range(num_partitions))
    return partition_by_key(key, every, every)


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    return make_tracked_producer(settings, **overrides)[0]


def make_tracked_producer(
    settings: Settings, **overrides: Any
) -> tuple[AIOKafkaProducer, ProducerTopics]:
    """A producer, and the topics it asks the broker about (``tokenbus.metadata``): for a
    sender that knows when it is done with a reply topic (``ProducerTopics.let_go``)."""
    options: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap,
        "acks": settings.kafka_acks,
        "enable_idempotence": settings.idempotent_producers,
        "linger_ms": settings.linger_ms,
        "max_batch_size": settings.producer_batch_bytes,
        "request_timeout_ms": settings.request_timeout_ms,
        "partitioner": partition_by_key,
    }
    options.update(overrides)
    producer = AIOKafkaProducer(**options)
    return producer, track_reply_topics(settings, producer)


def track_reply_topics(settings: Settings, producer: AIOKafkaProducer) -> ProducerTopics:
    """``producer`` asks the broker only about topics it sends to, and lets go of a
    reply topic it no longer sends to (``tokenbus.metadata``)."""
    return ProducerTopics(
        producer,
        forgettable=Topics(settings.topic_prefix).is_reply_topic,
        forget_after_s=settings.reply_topic_forget_s,
    )


def make_consumer(
    settings: Settings,
    *topics: str,
    group_id: str | None,
    background: bool = False,
    **overrides: Any,
) -> AIOKafkaConsumer:
    """A consumer on the settings' broker. ``background``: no request waits on what it
    reads (heartbeats, usage, spans, alerts, batch commands), so it takes the longer
    ``Settings.background_fetch_wait_ms`` and polls an idle broker less."""
    tansu.install_for_consumers(settings)
    options: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap,
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "fetch_max_wait_ms": (
            settings.background_fetch_wait_ms if background else settings.consumer_fetch_wait_ms
        ),
        "request_timeout_ms": settings.request_timeout_ms,
        "session_timeout_ms": int(settings.faust_session_timeout_s * 1000),
        "heartbeat_interval_ms": int(settings.faust_heartbeat_interval_s * 1000),
        "rebalance_timeout_ms": int(settings.faust_rebalance_timeout_s * 1000),
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


def publisher(producer: AIOKafkaProducer) -> Publish:
    async def publish(
        topic: str, key: bytes, value: bytes, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> Any:
        return await producer.send_and_wait(
            topic, value, key=key, headers=list(headers) if headers else None
        )

    return publish


def topic_plan(settings: Settings) -> TopicPlan:
    """The topic configs tokenbus creates its topics with."""
    return TopicPlan(
        Topics(settings.topic_prefix),
        live_retention_ms=settings.live_topic_retention_ms,
        batch_retention_ms=settings.batch_topic_retention_ms,
        content_retention_ms=settings.content_topic_retention_ms,
    )


async def ensure_topics(
    settings: Settings, partitions_by_topic: dict[str, int], *, timeout_s: float = 30.0
) -> None:
    """Creates the topics that do not exist yet, each with its planned configs
    (``topic_plan``), whichever service creates it first; existing ones are left as
    they are (``topic_config_drift`` tells whether they match the plan)."""
    plan = topic_plan(settings)
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap, request_timeout_ms=settings.request_timeout_ms
    )
    await _start_with_retry(admin.start, timeout_s)
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(
                name,
                num_partitions=n,
                replication_factor=settings.replication_factor,
                topic_configs=plan.configs(name),
            )
            for name, n in partitions_by_topic.items()
            if name not in existing
        ]
        if missing:
            try:
                await admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass  # a concurrent creator won the race: the topic is there either way
    finally:
        await admin.close()


@contextlib.asynccontextmanager
async def _admin(settings: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    """An admin client of the configured cluster, started, and closed after use."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap, request_timeout_ms=settings.request_timeout_ms
    )
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def topic_names(settings: Settings) -> set[str]:
    """Every topic the broker knows."""
    async with _admin(settings) as admin:
        return set(await admin.list_topics())


async def broker_count(settings: Settings) -> int:
    """How many brokers the cluster's metadata lists."""
    async with _admin(settings) as admin:
        return len((await admin.describe_cluster())["brokers"])


async def topic_configs_of(settings: Settings, names: Iterable[str]) -> dict[str, dict[str, str]]:
    """The configs the broker describes for each existing topic of ``names`` (a topic it
    does not know is left out)."""
    async with _admin(settings) as admin:
        wanted = set(names) & set(await admin.list_topics())
        if not wanted:
            return {}
        resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in sorted(wanted)]
        described: dict[str, dict[str, str]] = {}
        for response in await admin.describe_configs(resources):
            for resource in response.to_object()["resources"]:
                if resource["error_code"] != 0:
                    raise KafkaError(
                        f"describing topic {resource['resource_name']!r}: "
                        f"{resource['error_message']} (error {resource['error_code']})"
                    )
                described[resource["resource_name"]] = {
                    entry["config_names"]: entry["config_value"]
                    for entry in resource["config_entries"]
                    if entry["config_value"] is not None
                }
        return described


async def topic_config_drift(settings: Settings) -> list[ConfigDrift]:
    """Where the existing topics' configs differ from the plan's (``TopicPlan.named``):
    topics made before tokenbus planned them, or changed since (``tokenbus topics``)."""
    want = topic_plan(settings).named()
    return config_drift(want, await topic_configs_of(settings, want))


async def delete_topics(settings: Settings, names: Iterable[str]) -> dict[str, int]:
    """Deletes the topics; returns those the broker did not delete, with its error code.
    A refused deletion does not raise (most callers delete as housekeeping, where an old
    reply topic left behind does no harm); a broker that cannot be reached does."""
    wanted = list(names)
    async with _admin(settings) as admin:
        try:
            response = await admin.delete_topics(wanted)
        except KafkaError as exc:
            return dict.fromkeys(wanted, getattr(exc, "errno", -1))
    errors = response.to_object()["topic_error_codes"]
    return {each["topic"]: each["error_code"] for each in errors if each["error_code"] != 0}


async def _start_with_retry(start: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await start()
            return
        except KafkaError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def wait_for_broker(settings: Settings, timeout_s: float = 30.0) -> None:
    """Polls until the broker answers metadata requests. First until a bootstrap address
    takes TCP connections: a broker still starting is a retry, and aiokafka would log
    each refused connection as an error."""
    deadline = time.monotonic() + timeout_s
    while not await _any_accepts(settings.bootstrap):
        if time.monotonic() > deadline:
            raise KafkaConnectionError(f"no broker at {settings.bootstrap}")
        await asyncio.sleep(0.1)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap)
    await _start_with_retry(admin.start, max(1.0, deadline - time.monotonic()))
    await admin.close()


async def _any_accepts(bootstrap: str) -> bool:
    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 1.0)
        except (OSError, TimeoutError, ValueError):
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True
    return False
