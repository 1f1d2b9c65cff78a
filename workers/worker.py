"""The worker loop: a thin shell between the worker's Kafka topic and the engine.

# worker topic --> InferenceRequest --> Engine.generate (continuous batching)
# EngineDelta --> TokenChunk on the request's reply_to topic
# end of request --> exactly one UsageEvent on the usage topic
# every heartbeat_interval_s --> WorkerStatus on the heartbeats topic
# cancels topic (every partition, no group) --> CancelBook --> Engine.abort

Commits: many requests run at once and finish out of order. A request's offset is
marked done only after its last chunk and its UsageEvent have been acknowledged by
the broker, and the consumer commits only up to the first offset not yet done
(``OffsetTracker``). A crash therefore redelivers every request whose UsageEvent was
not yet written, and never skips one.

Cancels: every worker reads every cancel, from the end and with no group, and commits
nothing: a cancel is advice. A cancelled request still ends the normal way (its last
chunk with finish_reason ``abort``, then one UsageEvent with status ``cancelled`` and
the tokens generated until the abort), so the commit rule above is unchanged. A cancel
missed while a worker restarts only costs the tokens of a run to completion.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition

from schemas import (
    CancelRequest,
    ErrorInfo,
    FinishReason,
    InferenceRequest,
    SchemaError,
    TokenChunk,
    UsageEvent,
    UsageStatus,
    WorkerStatus,
    decode,
    encode,
)
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter_record
from tokenbus.kafka import ensure_topics, make_consumer, make_producer, publisher
from tokenbus.offsets import OffsetTracker
from tokenbus.topics import Topics, reply_key
from workers.cancels import CancelBook
from workers.interface import Engine, EngineDelta, GenerateParams

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}
COMMIT_INTERVAL_S = 0.2


def _elapsed_ms(since: datetime, until: datetime) -> float:
    return max(0.0, (until - since).total_seconds() * 1000)


class Worker:
    """Feeds one engine from one topic and reports every request exactly once."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self._settings = settings
        self._engine = engine
        self._topics = Topics(settings.topic_prefix)
        self.worker_id = settings.worker_id
        self.request_topic = self._topics.worker(self.worker_id)
        self._tracker = OffsetTracker()
        self._slots = asyncio.Semaphore(2 * engine.max_num_seqs)
        self._tasks: set[asyncio.Task[None]] = set()
        self._draining = False
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._cancel_consumer: AIOKafkaConsumer | None = None
        self._cancels = CancelBook()
        self._running: dict[str, str] = {}  # request_id -> tenant_id, while in the engine

    # -- lifecycle -----------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        await ensure_topics(self._settings, {self.request_topic: 1})
        self._producer = make_producer(self._settings)
        self._consumer = make_consumer(
            self._settings, self.request_topic, group_id=f"tokenbus-worker-{self.worker_id}"
        )
        await self._producer.start()
        await self._consumer.start()
        # Positioned before the first request is taken, so no cancel for one is missed.
        self._cancel_consumer = await self._follow_cancels()
        cancels = asyncio.create_task(self._cancel_loop(self._cancel_consumer))
        heartbeats = asyncio.create_task(self._heartbeat_loop(stop))
        log.info(
            "%s ready: serving %s from %s",
            self.worker_id,
            self._engine.model_name,
            self.request_topic,
        )
        try:
            await self._consume_loop(stop)
        finally:
            # Drain: take nothing new, finish what runs, say so in the heartbeat.
            self._draining = True
            await self._send_heartbeat()
            if self._tasks:
                log.info("draining %d requests", len(self._tasks))
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._commit()
            heartbeats.cancel()
            cancels.cancel()
            await asyncio.gather(cancels, return_exceptions=True)
            await self._cancel_consumer.stop()
            await self._consumer.stop()
            await self._producer.stop()

    async def _consume_loop(self, stop: asyncio.Event) -> None:
        assert self._consumer is not None
        last_commit = time.monotonic()
        while not stop.is_set():
            batches = await self._consumer.getmany(timeout_ms=100, max_records=64)
            for tp, records in batches.items():
                for record in records:
                    await self._slots.acquire()
                    self._tracker.start(tp.partition, record.offset)
                    task = asyncio.create_task(self._handle(record))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            if time.monotonic() - last_commit >= COMMIT_INTERVAL_S:
                await self._commit()
                last_commit = time.monotonic()

    async def _commit(self) -> None:
        assert self._consumer is not None
        offsets = {
            TopicPartition(self.request_topic, partition): offset
            for partition, offset in self._tracker.committable().items()
        }
        if offsets:
            await self._consumer.commit(offsets)

    # -- one request -----------------------------------------------------------------
    async def _handle(self, record: ConsumerRecord[bytes, bytes]) -> None:
        try:
            try:
                request = decode(InferenceRequest, record.value)
            except SchemaError as exc:
                assert self._producer is not None
                await dead_letter_record(
                    publisher(self._producer),
                    self._topics,
                    record,
                    consumer=self.worker_id,
                    reason=str(exc),
                )
                return
            await self._serve(request)
        except Exception:
            # Only a broker failure gets here; the offset stays uncommitted and the
            # request is redelivered after a restart.
            log.exception("request at offset %d was not reported", record.offset)
            return
        finally:
            self._slots.release()
        self._tracker.done(record.partition, record.offset)

    async def _serve(self, request: InferenceRequest) -> None:
        assert self._producer is not None
        producer = self._producer
        key = reply_key(request.tenant_id, request.request_id)
        started = datetime.now(UTC)
        first_token_at: datetime | None = None
        num_prompt = num_cached = num_completion = 0
        seq = 0
        finish = FinishReason.ERROR
        error: ErrorInfo | None = None
        sends: list[Awaitable[Any]] = []

        def chunk(
            delta_text: str,
            token_ids: list[int],
            reason: FinishReason | None,
            err: ErrorInfo | None = None,
        ) -> TokenChunk:
            return TokenChunk(
                request_id=request.request_id,
                tenant_id=request.tenant_id,
                seq=seq,
                text=delta_text,
                token_ids=token_ids,
                num_tokens=len(token_ids),
                finish_reason=reason,
                error=err,
                num_prompt_tokens=num_prompt if reason is not None else None,
            )

        tenant_id, request_id = request.tenant_id, request.request_id
        if self._cancels.is_cancelled(tenant_id, request_id, time.monotonic()):
            # Cancelled while queued or waiting for a slot: it never reaches the engine.
            await producer.send_and_wait(
                request.reply_to, encode(chunk("", [], FinishReason.ABORT)), key=key
            )
            await self._report(request, FinishReason.ABORT, started, None, 0, 0, 0, None)
            return
        self._running[request_id] = tenant_id
        abort_sent = False
        try:
            prompt = request.prompt
            if prompt is None:
                prompt = self._engine.render_chat([m.model_dump() for m in request.messages or []])
            params = GenerateParams(
                max_tokens=request.sampling.max_tokens,
                temperature=request.sampling.temperature,
                top_p=request.sampling.top_p,
                seed=request.sampling.seed,
                stop=list(request.sampling.stop),
                ignore_eos=request.sampling.ignore_eos,
            )
            delta: EngineDelta
            async for delta in self._engine.generate(
                request.request_id,
                prompt,
                params,
                priority=request.priority,
                cache_salt=request.cache_salt or request.tenant_id,
            ):
                if delta.num_prompt_tokens is not None:
                    num_prompt = delta.num_prompt_tokens
                    num_cached = delta.num_cached_tokens or 0
                if delta.token_ids and first_token_at is None:
                    first_token_at = datetime.now(UTC)
                if not abort_sent and self._cancels.is_cancelled(
                    tenant_id, request_id, time.monotonic()
                ):
                    # The cancel came before the engine knew the request: abort it now.
                    abort_sent = True
                    await self._engine.abort(request_id)
                num_completion += len(delta.token_ids)
                reason = _FINISH_REASONS.get(delta.finish_reason or "", None)
                if delta.finish_reason is not None and reason is None:
                    reason = FinishReason.STOP
                if not delta.token_ids and not delta.text and reason is None:
                    continue
                sends.append(
                    await producer.send(
                        request.reply_to,
                        encode(chunk(delta.text, delta.token_ids, reason)),
                        key=key,
                    )
                )
                seq += 1
                if reason is not None:
                    finish = reason
                    break
        except Exception as exc:
            log.exception("engine failed on %s", request.request_id)
            error = ErrorInfo(code="engine_error", message=f"{type(exc).__name__}: {exc}")
            finish = FinishReason.ERROR
            sends.append(
                await producer.send(request.reply_to, encode(chunk("", [], finish, error)), key=key)
            )
            seq += 1
        else:
            if finish is FinishReason.ERROR:
                # The engine ended without a finish reason: tell the client, never hang it.
                error = ErrorInfo(code="engine_error", message="engine ended the stream early")
                finish = FinishReason.ERROR
                sends.append(
                    await producer.send(
                        request.reply_to, encode(chunk("", [], finish, error)), key=key
                    )
                )
        finally:
            self._running.pop(request_id, None)
        await asyncio.gather(*sends)
        await self._report(
            request, finish, started, first_token_at, num_prompt, num_completion, num_cached, error
        )

    async def _report(
        self,
        request: InferenceRequest,
        finish: FinishReason,
        started: datetime,
        first_token_at: datetime | None,
        num_prompt: int,
        num_completion: int,
        num_cached: int,
        error: ErrorInfo | None,
    ) -> None:
        """The request's one UsageEvent, sent after its last chunk was acknowledged."""
        assert self._producer is not None
        finished = datetime.now(UTC)
        status = {
            FinishReason.ERROR: UsageStatus.FAILED,
            FinishReason.ABORT: UsageStatus.CANCELLED,
        }.get(finish, UsageStatus.OK)
        usage = UsageEvent(
            request_id=request.request_id,
            session_id=request.session_id,
            tenant_id=request.tenant_id,
            model=request.model,
            worker_id=self.worker_id,
            priority=request.priority,
            attempt=request.attempt,
            status=status,
            finish_reason=finish,
            num_prompt_tokens=num_prompt,
            num_completion_tokens=num_completion,
            num_cached_tokens=num_cached,
            queue_ms=_elapsed_ms(request.created_at, request.dispatched_at or started),
            ttft_ms=_elapsed_ms(request.created_at, first_token_at) if first_token_at else None,
            total_ms=_elapsed_ms(request.created_at, finished),
            error_code=error.code if error else None,
            overload_tier=request.overload_tier,
            precision=self._settings.served_precision,
            flags=request.flags,
            created_at=request.created_at,
            finished_at=finished,
        )
        await self._producer.send_and_wait(
            self._topics.usage, encode(usage), key=request.tenant_id.encode()
        )

    # -- cancels ---------------------------------------------------------------------------
    async def _follow_cancels(self) -> AIOKafkaConsumer:
        consumer = make_consumer(self._settings, group_id=None, auto_offset_reset="latest")
        await consumer.start()
        await consumer.topics()  # loads metadata, so the partitions below are known
        topic = self._topics.cancels
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or {0}]
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        for tp in partitions:
            await consumer.position(tp)  # resolves the end now, not at the first fetch
        return consumer

    async def _cancel_loop(self, consumer: AIOKafkaConsumer) -> None:
        async for record in consumer:
            try:
                cancel = decode(CancelRequest, record.value)
            except SchemaError as exc:
                # Every worker reads every cancel; the job's grouped consumer dead-letters
                # bad ones, so that one copy (not one per worker) reaches the DLQ.
                log.warning("ignoring a malformed cancel at offset %d: %s", record.offset, exc)
                continue
            self._cancels.note(cancel.tenant_id, cancel.request_id, time.monotonic())
            # Tenant and request must both match: a request ID alone is no capability.
            if self._running.get(cancel.request_id) == cancel.tenant_id:
                log.info("aborting %s: %s", cancel.request_id, cancel.reason)
                try:
                    await self._engine.abort(cancel.request_id)
                except Exception:
                    log.exception("abort of %s failed", cancel.request_id)

    # -- heartbeats ----------------------------------------------------------------------
    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._send_heartbeat()
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(self._settings.heartbeat_interval_s)

    async def _send_heartbeat(self) -> None:
        assert self._producer is not None
        stats = self._engine.stats()
        status = WorkerStatus(
            worker_id=self.worker_id,
            model=self._engine.model_name,
            request_topic=self.request_topic,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            max_num_seqs=self._engine.max_num_seqs,
            kv_cache_usage=stats.kv_cache_usage,
            tokens_per_s=stats.tokens_per_s,
            draining=self._draining,
        )
        await self._producer.send_and_wait(
            self._topics.heartbeats, encode(status), key=self.worker_id.encode()
        )
