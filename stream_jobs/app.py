"""The Faust app: topics and agents wired to the Dispatcher.

# requests.p0/p1/p2 --> admit agents --> Dispatcher --> worker topics / reply topics
# usage --> settle agent --> Dispatcher.observe_usage (quota settles on real counts)
# cancels --> cancel agent --> Dispatcher.handle_cancel (drops waiting requests)
# heartbeats --> registry task (every instance reads every heartbeat)

Commits: Faust acks an event when the agent's loop moves past it and commits acked
offsets every ``faust_commit_interval_s``. The admit agent moves on only after the
Dispatcher has forwarded, refused or dead-lettered the request, so nothing admitted
is lost; a crash redelivers at most the last interval's requests.
"""

from __future__ import annotations

import logging
from typing import Any

import faust
import orjson
from aiokafka import TopicPartition
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TableT

from stream_jobs.dispatcher import Dispatcher
from stream_jobs.metrics import render_metrics
from stream_jobs.replies import KafkaReplyLog
from stream_jobs.window import WindowState
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.topics import Topics

log = logging.getLogger(__name__)


def _bounded_fetch_wait(wait_ms: int) -> None:
    """Faust hard-codes fetch_max_wait_ms=1500; on a quiet topic that is added to every hop."""
    original = faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer
    if getattr(original, "_tokenbus_wait_ms", None) == wait_ms:
        return

    def create(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = wait_ms
        return consumer

    create._tokenbus_wait_ms = wait_ms  # type: ignore[attr-defined]
    faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer = create  # type: ignore[method-assign]


def _acks(value: int | str) -> int:
    return -1 if value == "all" else int(value)


class TableWindowStore:
    """Quota windows in a Faust table: each write goes to its changelog partition, and a
    restarted job recovers the table from the changelog before it consumes again."""

    def __init__(self, table: TableT[bytes, bytes]) -> None:
        self._table = table

    def load(self, tenant_id: str) -> WindowState:
        raw = self._table.get(tenant_id.encode())
        return WindowState.from_json(orjson.loads(raw) if raw else None)

    def save(self, tenant_id: str, state: WindowState) -> None:
        self._table[tenant_id.encode()] = orjson.dumps(state.to_json())


def create_app(settings: Settings) -> faust.App:
    _bounded_fetch_wait(settings.fetch_max_wait_ms)
    topics = Topics(settings.topic_prefix)
    brokers = ";".join(f"kafka://{host}" for host in settings.bootstrap.split(","))
    app = faust.App(
        settings.faust_app_id,
        broker=brokers,
        key_serializer="raw",
        value_serializer="raw",
        web_enabled=settings.faust_web_port is not None,
        web_port=settings.faust_web_port or 6066,
        web_bind="127.0.0.1",
        datadir=str(settings.home / "faust"),
        topic_partitions=settings.num_partitions,
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=True,
        broker_session_timeout=settings.faust_session_timeout_s,
        broker_rebalance_timeout=settings.faust_rebalance_timeout_s,
        broker_heartbeat_interval=settings.faust_heartbeat_interval_s,
        broker_commit_interval=settings.faust_commit_interval_s,
        producer_acks=_acks(settings.kafka_acks),
        producer_linger_ms=settings.linger_ms,
        consumer_auto_offset_reset="earliest",
    )
    # Keyed by tenant, like every stream that writes it: requests and usage are
    # co-partitioned, so one instance owns each tenant's window.
    windows = app.Table(
        "quota-windows",
        default=None,
        key_type=bytes,
        value_type=bytes,
        partitions=settings.num_partitions,
    )
    state: dict[str, Dispatcher] = {}

    async def publish(topic: str, key: bytes, value: bytes) -> Any:
        return await app.producer.send_and_wait(
            topic, key, value, partition=None, timestamp=None, headers=None
        )

    def dispatcher() -> Dispatcher:
        if "dispatcher" not in state:
            state["dispatcher"] = Dispatcher(
                settings, publish, TableWindowStore(windows), KafkaReplyLog(settings)
            )
        return state["dispatcher"]

    def admit_agent(priority: int) -> None:
        topic = app.topic(topics.requests(priority), key_type=bytes, value_type=bytes)

        async def admit(stream: faust.StreamT[bytes]) -> None:
            async for event in stream.events():
                message = event.message
                await dispatcher().handle_request(
                    message.topic, message.partition, message.offset, message.key, message.value
                )

        app.agent(topic, name=f"admit_p{priority}", concurrency=settings.admit_concurrency)(admit)

    for priority in (0, 1, 2):
        admit_agent(priority)

    usage_topic = app.topic(topics.usage, key_type=bytes, value_type=bytes)

    @app.agent(usage_topic, name="settle_usage")
    async def settle_usage(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            dispatcher().observe_usage(event.message.value)

    cancels_topic = app.topic(topics.cancels, key_type=bytes, value_type=bytes)

    @app.agent(cancels_topic, name="cancel_waiting")
    async def cancel_waiting(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            await dispatcher().handle_cancel(event.message.value)

    @app.task
    async def dispatch_loop() -> None:
        await dispatcher().run()

    @app.task
    async def follow_heartbeats() -> None:
        # No consumer group: every instance of the job must see every worker.
        consumer = make_consumer(settings, group_id=None, auto_offset_reset="latest")
        await consumer.start()
        try:
            await consumer.topics()  # loads metadata, so the partitions below are known
            partitions = consumer.partitions_for_topic(topics.heartbeats) or {0}
            consumer.assign([TopicPartition(topics.heartbeats, p) for p in partitions])
            async for record in consumer:
                dispatcher().observe_heartbeat(record.value)
        finally:
            await consumer.stop()

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        return web.bytes(render_metrics(dispatcher().metrics), content_type="text/plain")

    return app
