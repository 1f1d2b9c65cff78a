"""The batch runner service: which batches this instance drives (``python -m batches``).

# <prefix>.batches (group <prefix>-batches), each assigned partition from its start
# --> BatchCommand: create --> BatchRun (batches.run) unless its document is terminal
#                   cancel --> that run stops dispatching (batches.control)
# partitions revoked --> their runs stop (their state is on the reply topics and in the store)

Commands are keyed ``<tenant>/<batch_id>``, so a batch's create and cancel share a
partition and one runner instance drives it. Commits: none. On every assignment the
runner reads its partitions from the start and rebuilds the set of batches: a batch
whose document in the store is terminal is skipped, every other one is resumed (its
progress is on its reply topic). So a runner killed at any point resumes every batch it
held, and the commands topic, which holds two small records per batch, is all it needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition

from batches.metrics import RunnerMetrics
from batches.pacing import Pacer, Shares, create_pacer
from batches.run import BatchRun
from schemas import LoadReport, SchemaError, decode
from schemas.batches import BatchCommand, BatchDoc
from tokenbus.batch.commands import command_key
from tokenbus.batch.store import BatchStore, NotFound
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter_record
from tokenbus.kafka import make_consumer, make_producer, publisher
from tokenbus.retry import Backoff, until_done
from tokenbus.topics import Topics

log = logging.getLogger(__name__)
RETRY_S = 5.0
"""A failed run of a batch starts again after this."""
STORE_BACKOFF = Backoff(initial_s=0.5, max_s=30.0)
"""A status document that could not be read is read again after these waits, until it is."""


def runner_group_id(settings: Settings) -> str:
    return f"{settings.topic_prefix}-batches"


@dataclass
class _Running:
    run: BatchRun
    task: asyncio.Task[None]
    partition: int


class Runner:
    def __init__(
        self,
        settings: Settings,
        store: BatchStore,
        metrics: RunnerMetrics,
        pacer_factory: Callable[[], Pacer] | None = None,
    ) -> None:
        """``pacer_factory``: each batch's pacer. Unset, the batches share one AIMD pacer
        (``batches.pacing``) fed the job's load reports, each running batch an equal part
        of its limit."""
        self._settings = settings
        self._store = store
        self._metrics = metrics
        self._shares: Shares | None = None
        if pacer_factory is None:
            self._shares = Shares(create_pacer(settings))
            pacer_factory = self._shares.share
        self._pacer_factory = pacer_factory
        self._topics = Topics(settings.topic_prefix)
        self._runs: dict[tuple[str, str], _Running] = {}
        self._producer: AIOKafkaProducer | None = None

    async def serve(self) -> None:
        self._producer = make_producer(self._settings)
        await self._producer.start()
        consumer = make_consumer(
            self._settings, group_id=runner_group_id(self._settings), background=True
        )
        consumer.subscribe([self._topics.batches], listener=_FromTheStart(self, consumer))
        await consumer.start()
        loads = asyncio.create_task(self._follow_load()) if self._shares else None
        try:
            async for record in consumer:
                await self._handle(record)
        finally:
            if loads is not None:
                loads.cancel()
                await asyncio.gather(loads, return_exceptions=True)
            await self._stop_runs(set(range(1 << 16)))
            await consumer.stop()
            await self._producer.stop()

    async def _follow_load(self) -> None:
        """The job's load reports, from now on, into the shared pacer. No group and no
        commits: every runner reads every report, and old ones say nothing about now."""
        assert self._shares is not None and self._producer is not None
        consumer = make_consumer(
            self._settings, group_id=None, auto_offset_reset="latest", background=True
        )
        await consumer.start()
        try:
            await consumer.topics()  # loads metadata, so the partitions below are known
            topic = self._topics.load
            partitions = consumer.partitions_for_topic(topic) or {0}
            consumer.assign([TopicPartition(topic, p) for p in partitions])
            async for record in consumer:
                try:
                    report = decode(LoadReport, record.value)
                except SchemaError as exc:
                    await dead_letter_record(
                        publisher(self._producer),
                        self._topics,
                        record,
                        consumer=f"{runner_group_id(self._settings)}-load",
                        reason=str(exc),
                    )
                    continue
                self._shares.pacer.observe(report)
                self._metrics.pacer_limit.set(self._shares.pacer.limit())
        finally:
            await consumer.stop()

    async def _handle(self, record: object) -> None:
        assert self._producer is not None
        try:
            command = decode(BatchCommand, record.value)  # type: ignore[attr-defined]
            if record.key != command_key(command.tenant_id, command.batch_id):  # type: ignore[attr-defined]
                raise SchemaError("the key is not <tenant>/<batch_id> of the command")
        except SchemaError as exc:
            await dead_letter_record(
                publisher(self._producer),
                self._topics,
                record,
                consumer=runner_group_id(self._settings),
                reason=str(exc),
            )
            return
        key = (command.tenant_id, command.batch_id)
        running = self._runs.get(key)
        if command.kind == "cancel":
            if running is not None:
                log.info("%s/%s: cancel", *key)
                running.run.cancel()
            return
        if running is not None and not running.task.done():
            return  # a create read again after a rebalance: it runs already
        # The command loop waits for the store: no batch can start without its document,
        # and a batch skipped here would stay in_progress until the next rebalance.
        doc = await self._read_doc(key)
        if doc is None or doc.is_terminal:
            return
        run = BatchRun(
            self._settings, self._store, doc, self._pacer_factory(), self._metrics, self._producer
        )
        task = asyncio.create_task(self._drive(run), name=f"batch {command.batch_id}")
        self._runs[key] = _Running(run, task, record.partition)  # type: ignore[attr-defined]
        self._metrics.running.set(len(self._runs))

    async def _drive(self, run: BatchRun) -> None:
        """Runs the batch to its end; a run that fails (the broker or the store away)
        starts again from the store and the reply topic, as after a restart."""
        key = (run.doc.tenant, run.doc.id)
        try:
            while True:
                try:
                    await run.run()
                    return
                except Exception:
                    log.exception("%s/%s: the run failed; resuming in %g s", *key, RETRY_S)
                await asyncio.sleep(RETRY_S)
                doc = await self._read_doc(key)
                if doc is None or doc.is_terminal:
                    return
                cancelled = run.cancel_requested
                run = BatchRun(
                    self._settings, self._store, doc, self._pacer_factory(), self._metrics,
                    run.dead_letters,
                )  # fmt: skip
                if cancelled:
                    run.cancel()
                self._runs[key].run = run
        finally:
            self._runs.pop(key, None)
            self._metrics.running.set(len(self._runs))
            close = getattr(run.pacer, "close", None)
            if close is not None:
                close()  # its share of the pacer's limit goes to the other batches

    async def _read_doc(self, key: tuple[str, str]) -> BatchDoc | None:
        """The batch's status document, read again with ``STORE_BACKOFF`` while the store
        fails; None if the store has no such batch (it is skipped). Only a cancel of
        the caller's task ends the wait."""
        docs: list[BatchDoc | None] = []

        async def read() -> None:
            try:
                docs.append(await asyncio.to_thread(self._store.batch, *key))
            except NotFound:
                docs.append(None)  # an answer, not a failure: not retried

        what = f"{key[0]}/{key[1]}: reading the batch's status document"
        await until_done(read, asyncio.Event(), STORE_BACKOFF, what)
        if docs[0] is None:
            log.warning("%s/%s: no status document in the store; skipped", *key)
        return docs[0]

    async def _stop_runs(self, partitions: set[int]) -> None:
        stopping = [r for r in self._runs.values() if r.partition in partitions]
        for running in stopping:
            running.task.cancel()
        await asyncio.gather(*(r.task for r in stopping), return_exceptions=True)


class _FromTheStart(ConsumerRebalanceListener):  # type: ignore[misc]
    """Revoked partitions' runs stop; assigned partitions are read from their start."""

    def __init__(self, runner: Runner, consumer: AIOKafkaConsumer) -> None:
        self._runner = runner
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._runner._stop_runs({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        # Nothing is ever committed, so a new assignment starts at the earliest offset
        # anyway; the seek makes it so even for a group with offsets left by an operator.
        if assigned:
            await self._consumer.seek_to_beginning(*assigned)
