"""The worker loop: a thin shell between the worker's Kafka topic and the engine.

# worker topic --> InferenceRequest --> Engine.generate (continuous batching)
# EngineDelta --> TokenChunk on the request's reply_to topic
# end of request --> exactly one UsageEvent on the usage topic
# every heartbeat_interval_s --> WorkerStatus on the heartbeats topic

Commits: many requests run at once and finish out of order. A request's offset is
marked done only after its last chunk and its UsageEvent have been acknowledged by
the broker, and the consumer commits only up to the first offset not yet done
(``OffsetTracker``). A crash therefore redelivers every request whose UsageEvent was
not yet written, and never skips one.
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
from tokenbus.dlq import dead_letter
from tokenbus.kafka import ensure_topics, make_consumer, make_producer, publisher
from tokenbus.offsets import OffsetTracker
from tokenbus.topics import Topics, reply_key
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

    # -- lifecycle -----------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        await ensure_topics(self._settings, {self.request_topic: 1})
        self._producer = make_producer(self._settings)
        self._consumer = make_consumer(
            self._settings, self.request_topic, group_id=f"tokenbus-worker-{self.worker_id}"
        )
        await self._producer.start()
        await self._consumer.start()
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
                await dead_letter(
                    publisher(self._producer),
                    self._topics,
                    consumer=self.worker_id,
                    source_topic=record.topic,
                    partition=record.partition,
                    offset=record.offset,
                    key=record.key,
                    value=record.value,
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
            )

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
        await asyncio.gather(*sends)

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
        await producer.send_and_wait(
            self._topics.usage, encode(usage), key=request.tenant_id.encode()
        )

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
