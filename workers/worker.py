"""The worker loop: a thin shell between the worker's Kafka topic and the engine.

# worker topic --> WorkItem --> Engine.generate (continuous batching)
# EngineDelta --> Chunk (tokenbus.chunks) --> ReplyBatcher (one engine step's chunks)
# one engine step --> one TokenChunkBatch per (reply_to topic, tenant), keyed by tenant
# end of request --> exactly one UsageEvent on the usage topic
# every heartbeat_interval_s --> WorkerStatus on the heartbeats topic
# aborts topic (every partition, no group): checked cancels --> CancelBook --> Engine.abort

Delivery: the dispatcher, not this consumer's offsets, owns every request until its
UsageEvent arrives (across its own restarts too: its ledger says where each runs).
Each run of a worker has its own incarnation id, sent in every heartbeat and stamped
by the dispatcher on what it forwards. A run starts reading its
topic at the end and skips requests addressed to another run: when a run is lost, the
dispatcher sends its unfinished requests again (resuming their streams), so replaying
them here would run them twice. Nothing is committed, and a crash loses nothing the
dispatcher does not resend.

Replies: the chunks all requests make in one engine step leave as one TokenChunkBatch
record per (reply topic, tenant) (``workers.replies``), not one record per token. A
request's UsageEvent is sent only once every one of its chunks was acknowledged.

Presumed dead: a run that was only slow (paused, starved, cut off) may have been
declared lost, its requests sent elsewhere. The dispatcher then sends a ``reassigned``
cancel for each such attempt, and this run drops it without a word more: no chunk, no
UsageEvent. Its later heartbeats make it live again, for new work.

Cancels: producers' cancels reach the job, which checks their credential; it passes
the good ones, and its own ``reassigned``, to the aborts topic, which only tokenbus's
services write (the bridges put their own cancels there at once).
Every worker reads every abort, from the end and with no group, and commits nothing:
an abort is advice. A cancelled request still ends the normal way (its last
chunk with finish_reason ``abort``, then one UsageEvent with status ``cancelled`` and
the tokens generated until the abort), so the commit rule above is unchanged. A cancel
missed while a worker restarts only costs the tokens of a run to completion.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from opentelemetry.trace import Span, SpanKind, Tracer, get_current_span, use_span
from opentelemetry.util.types import AttributeValue

from schemas import (
    REASSIGNED,
    CancelRequest,
    ErrorInfo,
    FinishReason,
    SchemaError,
    WorkerStatus,
    WorkItem,
    decode,
    encode,
)
from tokenbus.batch_yield import YieldPolicy
from tokenbus.chunks import Chunk, ChunkError
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter_record
from tokenbus.finished_span import end_span
from tokenbus.kafka import ensure_topics, make_consumer, make_tracked_producer, publisher
from tokenbus.lean_span import start_span
from tokenbus.logs import request_context
from tokenbus.metadata import ProducerTopics
from tokenbus.metrics import create_tenant_labels, metrics_app, start_metrics_server
from tokenbus.retry import Backoff, until_done
from tokenbus.span_path import hop_span, path_ns
from tokenbus.tansu.fetch_wait import LoneRequests, expect_records
from tokenbus.topics import Topics
from tokenbus.tracing import (
    ATTR_ATTEMPT,
    ATTR_TENANT,
    Tracing,
    extract,
    inject,
    span_attributes,
    token_attributes,
    work_item_attributes,
)
from tokenbus.usage import usage_of
from workers.adapters import AdapterBook
from workers.batch_gate import BatchGate, SeatLearner
from workers.cancels import CancelBook
from workers.interface import (
    AdapterRef,
    Engine,
    EngineDelta,
    EngineTimings,
    GenerateOptions,
    GenerateParams,
    Prompt,
)
from workers.metrics import WorkerMetrics
from workers.replies import Deliveries, ReplyBatcher

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


def ids_digest(ids: list[int]) -> str:
    """A short digest of token ids, for logs that must not carry the text they encode."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def finish_of(engine_reason: str | None) -> tuple[FinishReason | None, ErrorInfo | None]:
    """vLLM's finish reason as tokenbus's, with the error to report: a reason tokenbus
    does not know (a newer vLLM's) ends the stream as an error that names it, never as a
    quiet ``stop``."""
    if engine_reason is None:
        return None, None
    reason = _FINISH_REASONS.get(engine_reason)
    if reason is FinishReason.ERROR:
        return reason, ErrorInfo(code="engine_error", message="the engine failed the request")
    if reason is None:
        return FinishReason.ERROR, ErrorInfo(
            code="engine_error",
            message=f"the engine finished the request with {engine_reason!r}, "
            "a reason this worker does not know",
        )
    return reason, None


ENGINE_PHASES = ("worker.engine_queue", "worker.prefill", "worker.decode")
"""Spans of a request inside vLLM, from its own timestamps: queued to first scheduled,
to first token, to last token."""


PATH_PHASES = (
    "worker.intake",
    "worker.engine_input",
    "worker.engine_queue",
    "worker.prefill",
    "worker.emit",
)
"""A request's path to its first token through the worker: record taken to the engine's
input processing starting (decode, checks, a chat's rendering, vLLM's own preamble, and
under load the wait for the thread vLLM processes inputs on), the engine's input
processing (tokenizing, the hand-off to its core), its queue, prefill, first token to
the reply record sent (vLLM's output processing, this loop, the reply batcher). The
direct arm of ``bench.overhead`` pays all but this worker's decode, checks and spans."""


def path_edges(taken_ns: int, engine_ns: Sequence[int], sent_ns: int) -> list[int]:
    """The edges of ``PATH_PHASES``: taken, the engine's arrival, queued, scheduled and
    first-token stamps, the first reply's send; each engine stamp held within its
    neighbours (a clock step between the processes shortens a phase to nothing, never
    makes one negative), so the phases tile taken..sent exactly."""
    end = max(taken_ns, sent_ns)
    edges = [taken_ns]
    for ns in engine_ns:
        edges.append(min(max(edges[-1], ns), end))
    edges.append(end)
    return edges


def request_span(
    tracer: Tracer,
    headers: Sequence[tuple[str, bytes]],
    taken_ns: int,
    attributes: Mapping[str, AttributeValue],
    hop_attributes: Mapping[str, AttributeValue],
) -> Span:
    """``worker.request`` from ``taken_ns``, under the trace context the record's headers
    carry; before it, the record's ``bus.dispatch`` hop from where its path stood."""
    parent = extract(headers)
    hop_span(tracer, "bus.dispatch", path_ns(headers), taken_ns, hop_attributes, context=parent)
    return start_span(
        tracer,
        "worker.request",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        start_time=taken_ns,
    )


def _elapsed_ms(since: datetime, until: datetime) -> float:
    return max(0.0, (until - since).total_seconds() * 1000)


_T = TypeVar("_T")


@asynccontextmanager
async def _closing(stream: AsyncIterator[_T]) -> AsyncIterator[AsyncIterator[_T]]:
    """Closes an engine's stream when its reader leaves it early (vLLM aborts it then)."""
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def create_batch_gate(settings: Settings, engine: Engine) -> BatchGate | None:
    """The gate over the engine's class 2 lines; None when its cap could never bind."""
    seats = settings.batch_yield_seats_per_worker
    if seats >= engine.max_num_seqs:
        return None
    policy = YieldPolicy(seats_per_worker=seats, hold_s=settings.batch_yield_hold_s)
    learner = SeatLearner(
        max_seats=seats,
        ratio=settings.batch_target_interactive_ratio,
        probe_after=settings.batch_yield_probe_after,
        probe_after_max=settings.batch_yield_probe_after_max,
    )
    return BatchGate(policy, "engine", engine.abort, learner=learner)


RETRY_WHILE_DRAINING_S = 60.0
"""How long a stopping worker still retries a UsageEvent the broker refuses."""


class Worker:
    """Feeds one engine from one topic and reports every request exactly once."""

    def __init__(
        self, settings: Settings, engine: Engine, *, tracing: Tracing | None = None
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._tracing = tracing or Tracing(settings, "worker")
        self._tracer = self._tracing.tracer
        self._topics = Topics(settings.topic_prefix)
        self.worker_id = settings.worker_id
        self.request_topic = self._topics.worker(self.worker_id)
        self.incarnation = uuid.uuid4().hex
        self._slots = asyncio.Semaphore(2 * engine.max_num_seqs)
        self._stopped = asyncio.Event()
        """Set once the worker has drained: what still fails to send is given up then."""
        self._backoff = Backoff()
        self._tasks: set[asyncio.Task[None]] = set()
        self._draining = False
        self._producer: AIOKafkaProducer | None = None
        self._producer_topics: ProducerTopics | None = None
        self._replying: dict[str, int] = {}
        """Reply topic --> requests of this worker that answer on it now."""
        self._replies: ReplyBatcher | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._cancel_consumer: AIOKafkaConsumer | None = None
        self._cancels = CancelBook()
        self._adapters = AdapterBook(engine)
        # (tenant, request_id) -> the engine's id of the attempt running now
        self._running: dict[tuple[str, str], str] = {}
        self._lone = LoneRequests()
        self._batch_gate = create_batch_gate(settings, engine)
        # Batch lines stream coarser: the runner collects them whole (config).
        self._batch_stream_interval = max(settings.stream_interval, settings.batch_stream_interval)
        self.metrics = WorkerMetrics(
            self.worker_id,
            engine,
            create_tenant_labels(settings.metrics_top_tenants, settings.metrics_tenant_half_life_s),
            lambda: self._consumer,
            self.request_topic,
        )
        if self._batch_gate is not None:
            gate = self._batch_gate
            waiting = self.metrics.batch_waiting.labels(engine.model_name, self.worker_id)
            waiting.set_function(lambda: gate.num_waiting)
            seats = self.metrics.batch_seats.labels(engine.model_name, self.worker_id)
            seats.set_function(lambda: gate.learner.seats)

    # -- lifecycle -----------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        await ensure_topics(self._settings, {self.request_topic: 1})
        self._producer, self._producer_topics = make_tracked_producer(self._settings)
        await self._producer.start()
        self._replies = ReplyBatcher(self._producer)
        self._consumer = await self._follow_requests()
        # Positioned before the first request is taken, so no cancel for one is missed.
        self._cancel_consumer = await self._follow_cancels()
        cancels = asyncio.create_task(self._cancel_loop(self._cancel_consumer))
        heartbeats = asyncio.create_task(self._heartbeat_loop())
        spans_stop = asyncio.Event()
        spans = asyncio.create_task(self._tracing.run(publisher(self._producer), spans_stop))
        metrics_server = await self._serve_metrics()
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
                draining = asyncio.gather(*self._tasks, return_exceptions=True)
                try:
                    await asyncio.wait_for(asyncio.shield(draining), RETRY_WHILE_DRAINING_S)
                except TimeoutError:
                    # Sends that still fail are given up now (the rest runs to its end):
                    # a broker that stays down must not keep the worker from stopping.
                    self._stopped.set()
                    await draining
            self._stopped.set()
            heartbeats.cancel()
            cancels.cancel()
            await asyncio.gather(cancels, return_exceptions=True)
            await self._cancel_consumer.stop()
            await self._consumer.stop()
            await self._replies.drain()
            spans_stop.set()
            await spans
            await self._producer.stop()
            if metrics_server is not None:
                await metrics_server.cleanup()

    async def _serve_metrics(self) -> Any:
        """``/metrics`` and ``/healthz`` on ``worker_metrics_port``, when it is set."""
        port = self._settings.worker_metrics_port
        if port is None:
            return None

        def health() -> dict[str, Any]:
            return {"status": "ok", "worker_id": self.worker_id, "draining": self._draining}

        app = metrics_app(self.metrics.registry, health)
        return await start_metrics_server(app, self._settings.worker_metrics_host, port)

    async def _follow_requests(self) -> AIOKafkaConsumer:
        """From the end of this worker's topic: what is there was for an earlier run."""
        consumer = make_consumer(self._settings, group_id=None, auto_offset_reset="latest")
        await consumer.start()
        tp = TopicPartition(self.request_topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)  # resolves the end now, before the first heartbeat
        return consumer

    async def _consume_loop(self, stop: asyncio.Event) -> None:
        assert self._consumer is not None
        while not stop.is_set():
            batches = await self._consumer.getmany(timeout_ms=100, max_records=64)
            for records in batches.values():
                for record in records:
                    await self._slots.acquire()
                    task = asyncio.create_task(self._handle(record))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    # -- one request -----------------------------------------------------------------
    async def _handle(self, record: ConsumerRecord[bytes, bytes]) -> None:
        taken_ns = time.time_ns()  # the bus's hop ends, this worker's path begins
        try:
            try:
                request = decode(WorkItem, record.value)
            except SchemaError as exc:
                await self._dead_letter(record, str(exc))
                return
            if request.worker_incarnation not in (None, self.incarnation):
                # Addressed to an earlier run of this worker: the dispatcher has already
                # sent it again, to whichever worker it picked.
                log.info("skipping %s: it was sent to an earlier run", request.request_id)
                return
            if not self._topics.is_reply_topic(request.reply_to):
                # Only the job writes here, and it checks; a record from anyone else
                # never makes this worker write outside the reply topics.
                await self._dead_letter(
                    record, f"reply_to {request.reply_to!r} is not a reply topic"
                )
                return
            attributes = work_item_attributes(
                request, attempt=request.attempt, worker=self.worker_id
            )
            hop: dict[str, AttributeValue] = {
                ATTR_TENANT: request.tenant_id,
                ATTR_ATTEMPT: request.attempt,
            }
            with (
                use_span(
                    request_span(self._tracer, record.headers, taken_ns, attributes, hop),
                    end_on_exit=True,
                ) as span,
                request_context(
                    tenant=request.tenant_id,
                    request_id=request.request_id,
                    session_id=request.session_id,
                    attempt=request.attempt,
                    batch_id=request.batch_id,
                    trace_id=f"{span.get_span_context().trace_id:032x}",
                ),
            ):
                self._replying[request.reply_to] = self._replying.get(request.reply_to, 0) + 1
                try:
                    await self._serve(request, taken_ns)
                finally:
                    self._done_replying(request.reply_to)
            if not self._running and self._lone.idle():
                # Idle after one request at a time: a caller that waited for this one's
                # end sends its next (tokenbus.tansu.fetch_wait; bundled broker only).
                expect_records(self._consumer)
        except Exception:
            # Only a broker failure gets here. The request's UsageEvent is missing, so
            # the dispatcher still holds it; it is resent if this run is lost.
            log.exception("request at offset %d was not reported", record.offset)
        finally:
            self._slots.release()

    def _done_replying(self, topic: str) -> None:
        left = self._replying[topic] - 1
        if left:
            self._replying[topic] = left
            return
        del self._replying[topic]
        # Nothing more for it until a request names it again: its client deletes a reply
        # topic it is done with, and a metadata request that names it would make the
        # bundled broker create it again (tokenbus.metadata).
        if self._producer_topics is not None:
            self._producer_topics.let_go(topic)

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        assert self._producer is not None
        await dead_letter_record(
            publisher(self._producer), self._topics, record, consumer=self.worker_id, reason=reason
        )

    async def _serve(self, request: WorkItem, taken_ns: int | None = None) -> None:
        """Runs one request; ``taken_ns``: when this worker took its record (the start of
        its part of the path to the first token, ``tokenbus.span_path``)."""
        assert self._replies is not None
        replies = self._replies
        started = datetime.now(UTC)
        started_s = time.monotonic()
        first_token_at: datetime | None = None
        num_at_first = 0  # completion tokens once the first delta's were counted
        # A resumed attempt continues the stream of an earlier one: its tokens were
        # delivered (and are billed here, once), its seq numbers carry on.
        resumed = request.resume_token_ids
        num_prompt = num_cached = 0
        num_completion = len(resumed)
        seq = request.resume_seq
        finish = FinishReason.ERROR
        error: ErrorInfo | None = None
        deliveries = Deliveries()  # the records of this request's chunks in flight
        first_reply: asyncio.Future[int] | None = None  # the record of its first chunk
        reply_to = request.reply_to
        tenant_id, request_id, attempt = request.tenant_id, request.request_id, request.attempt

        def chunk(
            delta_text: str,
            token_ids: list[int],
            reason: FinishReason | None,
            err: ErrorInfo | None = None,
        ) -> Chunk:
            return Chunk(
                request_id=request_id,
                tenant_id=tenant_id,
                seq=seq,
                text=delta_text,
                token_ids=token_ids,
                num_tokens=len(token_ids),
                finish_reason=reason,
                error=ChunkError(**err.model_dump(exclude_none=True)) if err else None,
                num_prompt_tokens=num_prompt if reason is not None else None,
            )

        cancelled = self._cancels.reason(tenant_id, request_id, attempt, time.monotonic())
        if cancelled == REASSIGNED:
            log.info("dropping %s attempt %d: reassigned", request_id, attempt)
            return
        if cancelled is not None:
            # Cancelled while queued or waiting for a slot: it never reaches the engine.
            try:
                await replies.add(request.reply_to, chunk("", [], FinishReason.ABORT))
            except Exception as exc:  # its UsageEvent goes all the same
                log.warning("%s: its last chunk did not reach %s: %s", request_id, reply_to, exc)
            await self._report(request, FinishReason.ABORT, started, None, 0, 0, 0, None)
            return
        engine_id = request.engine_request_id
        self._running[(tenant_id, request_id)] = engine_id
        self._lone.running(len(self._running))
        interactive = self._batch_gate is not None and request.priority < 2
        if interactive:
            assert self._batch_gate is not None
            self._batch_gate.interactive_started()
            await self._batch_gate.aborts_sent()
        abort_sent = False
        num_at_cancel: int | None = None  # completion tokens when the loop saw the cancel
        ended = False  # the engine gave its finish reason
        timings: EngineTimings | None = None
        try:
            prompt: Prompt
            if request.prompt is not None:
                prompt = request.prompt
            else:
                messages = [m.model_dump() for m in request.messages or []]
                prompt = await self._engine.render_chat(messages)
            adapter = None
            if request.adapter is not None:
                if not self._engine.max_loras:
                    raise RuntimeError(
                        f"adapter {request.adapter.name!r}: this worker serves no adapters"
                    )
                adapter = AdapterRef(**request.adapter.model_dump())
                await self._adapters.ensure(adapter, request_id)
            if resumed:
                ids = prompt if isinstance(prompt, list) else self._engine.tokenize(prompt)
                prompt = ids + resumed
                # Counts and digests only: token ids are the tenant's text.
                log.info(
                    "resuming %s (attempt %d): %d prompt ids (%s) + %d delivered ids (%s)",
                    request_id,
                    request.attempt,
                    len(ids),
                    ids_digest(ids),
                    len(resumed),
                    ids_digest(resumed),
                )
            params = GenerateParams(
                max_tokens=max(1, request.sampling.max_tokens - len(resumed)),
                temperature=request.sampling.temperature,
                top_p=request.sampling.top_p,
                seed=request.sampling.seed,
                stop=list(request.sampling.stop),
                ignore_eos=request.sampling.ignore_eos,
            )
            delta: EngineDelta
            async with _closing(
                self._generate(request, engine_id, prompt, params, adapter)
            ) as deltas:
                async for delta in deltas:
                    cancelled = self._cancels.reason(
                        tenant_id, request_id, attempt, time.monotonic()
                    )
                    if cancelled == REASSIGNED:
                        # Presumed dead, this run's request went to another worker: say
                        # nothing more (closing the stream aborts it in vLLM).
                        log.info("dropping %s attempt %d: reassigned", request_id, attempt)
                        return
                    if delta.num_prompt_tokens is not None:
                        num_prompt = delta.num_prompt_tokens - len(resumed)
                        num_cached = delta.num_cached_tokens or 0
                    if delta.token_ids and first_token_at is None:
                        first_token_at = datetime.now(UTC)
                        num_at_first = num_completion + len(delta.token_ids)
                        if interactive:
                            assert self._batch_gate is not None
                            self.metrics.batch_learned(
                                self._engine.model_name,
                                self._batch_gate.interactive_first_token(
                                    time.monotonic() - started_s
                                ),
                            )
                    if cancelled is not None and num_at_cancel is None:
                        num_at_cancel = num_completion
                    if not abort_sent and cancelled is not None:
                        # The cancel came before the engine knew the request: abort it now.
                        abort_sent = True
                        await self._engine.abort(
                            self._running.get((tenant_id, request_id), engine_id)
                        )
                    num_completion += len(delta.token_ids)
                    reason, problem = finish_of(delta.finish_reason)
                    if problem is not None:
                        log.warning("%s: %s", request_id, problem.message)
                        error = problem
                    if not delta.token_ids and not delta.text and reason is None:
                        continue
                    # Not awaited: the batcher sends this step's chunks of every request
                    # together, in the next loop iteration.
                    delivered = replies.add(
                        reply_to, chunk(delta.text, delta.token_ids, reason, problem)
                    )
                    deliveries.track(delivered)
                    if first_reply is None:
                        first_reply = delivered
                    seq += 1
                    if reason is not None:
                        finish = reason
                        ended = True
                        timings = delta.timings
                        break
        except Exception as exc:
            log.exception("engine failed on %s", request.request_id)
            error = ErrorInfo(code="engine_error", message=f"{type(exc).__name__}: {exc}")
            finish = FinishReason.ERROR
            deliveries.track(replies.add(reply_to, chunk("", [], finish, error)))
            seq += 1
        else:
            if not ended:
                # The engine ended without a finish reason: tell the client, never hang it.
                error = ErrorInfo(code="engine_error", message="engine ended the stream early")
                finish = FinishReason.ERROR
                deliveries.track(replies.add(reply_to, chunk("", [], finish, error)))
        finally:
            self._running.pop((tenant_id, request_id), None)
            if num_at_cancel is not None:
                self.metrics.cancelled(
                    tenant_id,
                    self._engine.model_name,
                    request.priority,
                    num_completion - num_at_cancel,
                )
            if interactive:
                assert self._batch_gate is not None
                self._batch_gate.interactive_ended()
        itl_s = None
        if first_token_at is not None and num_completion > num_at_first:
            decode_s = (datetime.now(UTC) - first_token_at).total_seconds()
            itl_s = decode_s / (num_completion - num_at_first)
        try:
            await deliveries.wait()
        except Exception as exc:
            # Its client cannot have had every chunk (its reply topic gone, say), but the
            # engine did the work: the request ends as failed, and its one UsageEvent
            # still goes, so it is billed and the job frees its seat.
            log.warning("%s: not every chunk reached %s: %s", request_id, reply_to, exc)
            finish = FinishReason.ERROR
            error = ErrorInfo(
                code="reply_undeliverable",
                message=f"the reply topic did not take every chunk: {type(exc).__name__}",
            )
        first_sent_ns = None
        if first_reply is not None and first_reply.done() and not first_reply.cancelled():
            first_sent_ns = None if first_reply.exception() else first_reply.result()
        self._engine_spans(
            request,
            timings,
            token_attributes(num_prompt, num_completion, num_cached),
            taken_ns,
            first_sent_ns,
        )
        await self._report(
            request,
            finish,
            started,
            first_token_at,
            num_prompt,
            num_completion,
            num_cached,
            error,
            last_seq=seq - 1,
            itl_s=itl_s,
        )

    async def _generate(
        self,
        request: WorkItem,
        engine_id: str,
        prompt: Prompt,
        params: GenerateParams,
        adapter: AdapterRef | None,
    ) -> AsyncIterator[EngineDelta]:
        """The engine's deltas for one attempt. A class 2 line waits for the batch gate,
        and one the gate pauses goes on later from its prompt and the tokens it made, in
        one stream: the pause's own abort is not a finish, later parts carry no prompt
        counts, and the last delta's times start at the first part's."""
        gate = self._batch_gate
        options = GenerateOptions(
            priority=request.priority,
            cache_salt=request.cache_salt,
            adapter=adapter,
            stream_interval=self._batch_stream_interval if request.priority >= 2 else None,
        )
        if gate is None or request.priority < 2:
            async with _closing(self._engine.generate(engine_id, prompt, params, options)) as it:
                async for delta in it:
                    yield delta
            return
        key = (request.tenant_id, request.request_id)
        made: list[int] = []  # token ids this attempt generated, over all its parts
        prompt_ids: list[int] | None = None
        first: EngineTimings | None = None
        counted = False  # the request's prompt counts went out, on a delta yielded
        held: tuple[int, int | None] | None = None  # counts a swallowed pause carried
        part = 0
        paused = False
        while True:
            await gate.enter(key, paused_before=paused)
            part_id = engine_id if part == 0 else f"{engine_id}/part{part}"
            if not gate.bind(key, part_id):
                gate.leave(key)  # paused before it started
                paused = True
                continue
            cancelled = self._cancels.reason(*key, request.attempt, time.monotonic())
            if part and cancelled is not None:
                gate.leave(key)  # cancelled while paused: no more engine work
                yield EngineDelta("", [], "abort")
                return
            self._running[key] = part_id
            part_prompt, part_params = prompt, params
            if part:
                if prompt_ids is None:
                    prompt_ids = (
                        prompt if isinstance(prompt, list) else self._engine.tokenize(prompt)
                    )
                part_prompt = prompt_ids + made
                part_params = replace(params, max_tokens=max(1, params.max_tokens - len(made)))
            finished = False
            try:
                async with _closing(
                    self._engine.generate(part_id, part_prompt, part_params, options)
                ) as it:
                    async for delta in it:
                        made += delta.token_ids
                        if part and (counted or held is not None):
                            # A later part's prompt holds the tokens made before it: the
                            # request's counts are the first part's, sent or held.
                            num_prompt, num_cached = (None, None) if counted else held or (0, 0)
                            delta = replace(
                                delta, num_prompt_tokens=num_prompt, num_cached_tokens=num_cached
                            )
                        if delta.finish_reason == "abort" and gate.is_paused(key):
                            first = first or delta.timings
                            if delta.token_ids or delta.text:
                                counted |= delta.num_prompt_tokens is not None
                                yield replace(delta, finish_reason=None, timings=None)
                            elif delta.num_prompt_tokens is not None:
                                # Paused before its first token (vLLM answers the abort
                                # with the prompt's counts and no token): they go out
                                # with the line's first token, whichever part makes it.
                                held = (delta.num_prompt_tokens, delta.num_cached_tokens)
                            break
                        if delta.finish_reason is not None:
                            finished = True
                            if first is not None and delta.timings is not None:
                                delta = replace(
                                    delta,
                                    timings=replace(first, last_token=delta.timings.last_token),
                                )
                        counted |= delta.num_prompt_tokens is not None
                        yield delta
                        if finished:
                            return
            finally:
                was_paused = gate.leave(key)
            if not was_paused:
                return  # ended without a finish: the caller reports it
            paused = True
            part += 1
            self.metrics.batch_pauses.labels(self._engine.model_name, self.worker_id).inc()
            log.info(
                "%s paused for interactive work after %d tokens", request.request_id, len(made)
            )

    async def _report(
        self,
        request: WorkItem,
        finish: FinishReason,
        started: datetime,
        first_token_at: datetime | None,
        num_prompt: int,
        num_completion: int,
        num_cached: int,
        error: ErrorInfo | None,
        last_seq: int | None = None,
        itl_s: float | None = None,
    ) -> None:
        """The request's one UsageEvent, sent after its last chunk was acknowledged."""
        assert self._producer is not None
        finished = datetime.now(UTC)
        self.metrics.request_done(
            request.tenant_id,
            request.requested_model,
            request.priority,
            finish.value,
            max(0, num_completion - len(request.resume_token_ids)),
            (first_token_at - started).total_seconds() if first_token_at else None,
            itl_s,
        )
        usage = usage_of(
            request,
            finish,
            worker_id=self.worker_id,
            num_prompt_tokens=num_prompt,
            num_completion_tokens=num_completion,
            num_cached_tokens=num_cached,
            queue_ms=_elapsed_ms(request.created_at, request.dispatched_at or started),
            ttft_ms=_elapsed_ms(request.created_at, first_token_at) if first_token_at else None,
            total_ms=_elapsed_ms(request.created_at, finished),
            error_code=error.code if error else None,
            precision=self._settings.served_precision,
            finished_at=finished,
            last_seq=request.resume_seq if last_seq is None else last_seq,
        )
        headers: list[tuple[str, bytes]] = []
        inject(headers)  # billing's row of this attempt joins the request's trace
        producer, value, key = self._producer, encode(usage), request.tenant_id.encode()

        async def send() -> None:
            await producer.send_and_wait(self._topics.usage, value, key=key, headers=headers)

        # Retried while the broker refuses it: the job frees the request's seat, and
        # billing charges its work, on this event alone. Given up only once the worker
        # stops; the job then sends the request again as its run is lost.
        what = f"the usage of {request.request_id} (attempt {request.attempt})"
        if not await until_done(send, self._stopped, self._backoff, what):
            log.error("%s was not sent; the worker stops", what)
            return
        log.debug(
            "reported: %s",
            usage.status.value,
            extra={
                "finish_reason": finish.value,
                "num_prompt_tokens": num_prompt,
                "num_completion_tokens": num_completion,
                "ttft_ms": usage.ttft_ms,
                "total_ms": usage.total_ms,
            },
        )

    def _engine_spans(
        self,
        request: WorkItem,
        timings: EngineTimings | None,
        counts: dict[str, int],
        taken_ns: int | None = None,
        first_sent_ns: int | None = None,
    ) -> None:
        """The engine's queue, prefill and decode, as children of the request's span,
        at the times vLLM's engine core stamped (moved from its monotonic clock to the
        wall clock spans use). With ``taken_ns`` and the first reply's send, the path to
        the first token through this worker (``path_edges``): ``worker.intake``, the
        engine's input processing, queue and prefill, ``worker.emit``."""
        current = get_current_span()
        current.set_attributes(counts)
        if timings is None or not current.is_recording():
            return
        to_wall_ns = time.time_ns() - time.monotonic_ns()
        stamps = [
            round(t * 1e9) + to_wall_ns
            for t in (timings.queued, timings.scheduled, timings.first_token, timings.last_token)
        ]
        attributes = span_attributes(
            tenant=request.tenant_id, request_id=request.request_id, attempt=request.attempt
        )
        phases: list[tuple[str, int, int]]
        if taken_ns is not None and first_sent_ns is not None:
            # An engine that gives no arrival: its input processing stays in the intake.
            arrival = round(timings.arrival * 1e9) if timings.arrival else stamps[0]
            edges = path_edges(taken_ns, [arrival, *stamps[:3]], first_sent_ns)
            phases = list(zip(PATH_PHASES, edges, edges[1:], strict=False))
            first_token = edges[-2]  # prefill's end, emit's start
            phases.append(("worker.decode", first_token, max(first_token, stamps[3])))
        else:
            phases = [
                (name, start, max(start, end))
                for name, start, end in zip(ENGINE_PHASES, stamps, stamps[1:], strict=False)
            ]
        for name, start, end in phases:
            end_span(self._tracer, name, start, end, attributes)

    # -- cancels ---------------------------------------------------------------------------
    async def _follow_cancels(self) -> AIOKafkaConsumer:
        """Aborts take the background fetch wait: no first token waits on them, and on
        the bundled broker this consumer, idle nearly always, would otherwise poll as
        often as the worker's request topic (a cancel then lands up to about half that
        wait later, 50 ms at 100; Apache Kafka answers it on arrival either way)."""
        consumer = make_consumer(
            self._settings, group_id=None, auto_offset_reset="latest", background=True
        )
        await consumer.start()
        await consumer.topics()  # loads metadata, so the partitions below are known
        topic = self._topics.aborts
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
                # Only the job writes aborts, and it dead-letters bad cancels itself.
                log.warning("ignoring a malformed abort at offset %d: %s", record.offset, exc)
                continue
            self._cancels.note(
                cancel.tenant_id,
                cancel.request_id,
                time.monotonic(),
                attempt=cancel.attempt,
                reason=cancel.reason,
            )
            if cancel.reason == REASSIGNED:
                continue  # its stream ends silently at its next step; no abort chunk
            # Tenant and request must both match: a request ID alone is no capability.
            running = self._running.get((cancel.tenant_id, cancel.request_id))
            if running is not None:
                trip_s = max(0.0, time.time() - record.timestamp / 1000)
                self.metrics.cancel_trip.labels(self._engine.model_name, self.worker_id).observe(
                    trip_s
                )
                log.info(
                    "aborting %s: %s, sent %.0f ms ago",
                    cancel.request_id,
                    cancel.reason,
                    trip_s * 1000,
                )
                try:
                    await self._engine.abort(running)
                except Exception:
                    log.exception("abort of %s failed", cancel.request_id)

    # -- heartbeats ----------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        """Until cancelled: a draining worker goes on saying it is alive and draining."""
        while True:
            try:
                await self._send_heartbeat()
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(self._settings.heartbeat_interval_s)

    async def _send_heartbeat(self) -> None:
        assert self._producer is not None
        stats = self._engine.stats()
        if self._engine.max_loras:
            try:
                await self._adapters.refresh()
            except Exception:
                log.exception("could not read the adapters the engine holds")
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
            incarnation=self.incarnation,
            max_loras=self._engine.max_loras,
            adapters=self._adapters.held_names(),
            num_adapter_loads=self._adapters.num_loads,
            last_adapter_load_ms=self._adapters.last_load_ms,
        )
        await self._producer.send_and_wait(
            self._topics.heartbeats, encode(status), key=self.worker_id.encode()
        )
