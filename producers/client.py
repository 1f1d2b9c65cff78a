"""``TokenbusClient``: produce an InferenceRequest, iterate over its TokenChunks.

# InferenceRequest + credential (``authorization`` header) --> requests.p{priority}, keyed by tenant
# replies.{client_id} --> TokenChunkBatch (tokenbus.chunks) --> per-request inboxes --> ``stream()``
# ``cancel()`` --> CancelRequest on the cancels topic (keyed by tenant)

Each client owns its reply topic and reads it without a consumer group from the end,
positioned before the first request is sent, so no reply can be missed. Nothing is
committed: a reply stream is live, and a client that restarts asks again. On the
bundled broker a client moves to a fresh reply topic every
``Settings.reply_topic_records`` records, reading the old one until its streams end
(``producers.reply_topics``).

Credentials: a client of one tenant (``tenant_id=``, with its API key or JWT as
``credential``) names its reply topic ``<prefix>.replies.<tenant>.<client_id>``, which
every credential of that tenant owns. A client for many tenants (the bridge, tools)
gives a function ``(tenant_id, reply_prefix) -> token`` that mints tokens carrying its
reply topics' prefix (``reply_prefix``). A chunk reaches a stream only if both its tenant and
its request id are the stream's.

Reading: one ``getmany`` per fetch, one decode per record (``tokenbus.chunks``: types,
required fields and the batch's tenant checked in one pass; the record's key must be
that tenant's), and a record that fails any check goes to the dead-letter topic with
its reason. A stream waits on a future of its own, with one timer per quiet spell
rather than one per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, TypedDict, Unpack

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import ConsumerStoppedError
from opentelemetry.trace import Span, SpanKind, StatusCode, set_span_in_context

from producers.inbox import Inbox
from producers.reply_stream import ReplyStream
from producers.reply_topics import ReplyTopics
from schemas import (
    CancelRequest,
    ChatMessage,
    ErrorInfo,
    InferenceRequest,
    SamplingParams,
    SchemaError,
    encode,
)
from tokenbus.chunks import Chunk, ChunkError, decode_batch
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter_record
from tokenbus.ids import new_request_id, new_session_id, ulid
from tokenbus.kafka import delete_topics, ensure_topics, make_consumer, make_producer, publisher
from tokenbus.lean_span import start_span
from tokenbus.prompt_vouch import HEADER as VOUCH_HEADER
from tokenbus.prompt_vouch import vouch
from tokenbus.replies import KafkaReplyLog
from tokenbus.span_path import path_ns
from tokenbus.tansu.fetch_wait import LoneRequests, expect_records
from tokenbus.topics import Topics, reply_batch_key
from tokenbus.tracing import Tracing, inject, span_attributes, with_path

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """The request ended with an error chunk (rejected, no worker, engine error)."""

    def __init__(self, error: ErrorInfo | ChunkError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


Credential = str | Callable[[str, str], str]
"""A tenant's API key or JWT, or ``(tenant_id, reply_prefix) -> token`` for many tenants."""
StreamKey = tuple[str, str]
"""(tenant, request_id)."""


class SubmitOptions(TypedDict, total=False):
    """What a producer may say of one request beyond its tenant (``submit``'s keywords).

    Left out: ``priority`` 1, ``model`` the served model, ``sampling`` the defaults,
    new session and request IDs, and the client's own credential. Naming a batch is
    not among them: only ``TokenbusClient.submit`` takes ``batch_id``.
    ``num_prompt_tokens``: the prompt's count with the model's tokenizer, which a tokenbus
    service's client vouches for on the record (``tokenbus.prompt_vouch``) so that the
    job need not count it again; any other client is refused it."""

    prompt: str | None
    messages: list[ChatMessage] | None
    model: str | None
    priority: int
    sampling: SamplingParams | None
    session_id: str | None
    request_id: str | None
    credential: str | None
    num_prompt_tokens: int | None


class TokenbusClient:
    """An async client for programs that produce requests; one reply topic per client."""

    def __init__(
        self,
        settings: Settings,
        client_id: str | None = None,
        *,
        credential: Credential | None = None,
        tenant_id: str | None = None,
        reply_reader: bool = True,
        tracing: Tracing | None = None,
        request_spans: bool = True,
    ) -> None:
        """``reply_reader=False``: the caller reads the reply topic itself (the batch
        runner replays it from its start, as a durable log); the client then neither
        reads it nor deletes it on close.

        ``tracing``: this process's tracer; its spans are sent with this client's
        producer. With ``request_spans``, each request gets a ``client.request`` span
        from submit to its last chunk; without, the request still carries whatever span
        is current at submit (the bridge's own) to the job."""
        if isinstance(credential, str) and tenant_id is None:
            raise ValueError(
                "a client with one tenant's key or token needs tenant_id=: its reply "
                "topic is named for the tenant"
            )
        self._settings = settings
        self._topics = Topics(settings.topic_prefix)
        self.client_id = client_id or ulid().lower()
        self.tenant_id = tenant_id
        self._reply_reader = reply_reader
        self._service = credential is None and bool(settings.bus_service_secret)
        if self._service:
            # A service of tokenbus's own (the bridge, the local stack, tests, benchmarks)
            # holds the service secret, and vouches for the tenants it names.
            assert settings.bus_service_secret is not None
            credential = _service_credential(settings.bus_service_secret)
        self.credential = credential
        # Rolls only where this client's tokens are minted for its prefix: a key or token
        # given to it may name one reply topic exactly (a JWT's ``reply_prefix``).
        rolls = reply_reader and callable(credential)
        self._reply_topics = ReplyTopics(
            self._topics.replies(f"{tenant_id}.{self.client_id}" if tenant_id else self.client_id),
            settings.reply_topic_records if rolls else None,
            delete_again_after_s=2 * settings.reply_topic_forget_s + 1,
        )
        self._stream_topics: dict[StreamKey, str] = {}
        """The reply topic of each open stream: an old one is read until none is left."""
        self._housekeeping: set[asyncio.Task[object]] = set()
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._streams: dict[StreamKey, Inbox[Chunk]] = {}
        self._lone = LoneRequests()
        self._created: dict[StreamKey, datetime] = {}
        self._reply_log: KafkaReplyLog | None = None
        self._tracing = tracing
        self._request_spans = request_spans and tracing is not None
        self._spans: dict[StreamKey, Span] = {}
        self._reply_sent: OrderedDict[StreamKey, int] = OrderedDict()
        self._flush_stop = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._watched = asyncio.Event()
        """Set when a stream is watched: the reply reader, paused while none was open,
        fetches again."""

    @property
    def reply_topic(self) -> str:
        """Where new requests' replies go."""
        return self._reply_topics.current

    @property
    def reply_prefix(self) -> str:
        """What a token minted for this client's requests names as its reply topics."""
        return self._reply_topics.prefix

    @property
    def reply_consumer(self) -> AIOKafkaConsumer | None:
        """The reply topic's consumer once started (its lag is a metric of the bridge)."""
        return self._consumer

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        await ensure_topics(self._settings, {self.reply_topic: 1})
        self._producer = make_producer(self._settings)
        if not self._reply_reader:
            await self._producer.start()
            return
        self._consumer = make_consumer(self._settings, group_id=None)
        await self._producer.start()
        await self._consumer.start()
        tp = TopicPartition(self.reply_topic, 0)
        self._consumer.assign([tp])
        await self._consumer.seek_to_end(tp)
        await self._consumer.position(tp)  # resolves the end offset before any request
        self._reader = asyncio.create_task(self._read_replies())
        if self._tracing is not None:
            publish = publisher(self._producer)
            self._flusher = asyncio.create_task(self._tracing.run(publish, self._flush_stop))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for span in self._spans.values():
            span.end()
        self._spans.clear()
        if self._flusher is not None:
            self._flush_stop.set()
            await self._flusher
        if self._consumer is not None:
            await self._consumer.stop()
        if self._reply_log is not None:
            await self._reply_log.stop()
        if self._producer is not None:
            await self._producer.stop()
        if self._housekeeping:
            await asyncio.gather(*self._housekeeping, return_exceptions=True)
        if self._reply_reader:
            await delete_topics(self._settings, self._reply_topics.owned)

    def headers(self, tenant_id: str, credential: str | None = None) -> list[tuple[str, bytes]]:
        """The record headers that carry the credential for ``tenant_id``."""
        token = credential
        if token is None:
            if callable(self.credential):
                token = self.credential(tenant_id, self.reply_prefix)
            else:
                token = self.credential
        return [("authorization", f"Bearer {token}".encode())] if token else []

    async def submit(
        self,
        *,
        tenant_id: str | None = None,
        batch_id: str | None = None,
        **options: Unpack[SubmitOptions],
    ) -> InferenceRequest:
        """Produces the request; read its chunks with ``stream(request)``.

        ``credential``: this request's token, instead of the client's. ``batch_id``: the
        batch job the request is a line of (class 2)."""
        assert self._producer is not None, "call start() first"
        tenant = tenant_id or self.tenant_id
        if tenant is None:
            raise ValueError("submit needs tenant_id= (this client serves many tenants)")
        num_prompt = options.get("num_prompt_tokens")
        if num_prompt is not None and not self._service:
            raise ValueError(
                "num_prompt_tokens is vouched for with the bus's service secret: only a "
                "tokenbus service's client (the bridge's) sends it"
            )
        created = datetime.now(UTC)
        prompt, priority = options.get("prompt"), options.get("priority", 1)
        text = {"prompt": prompt} if prompt is not None else {"messages": options.get("messages")}
        request = InferenceRequest.model_validate(
            {
                "request_id": options.get("request_id") or new_request_id(),
                "session_id": options.get("session_id") or new_session_id(),
                "tenant_id": tenant,
                "priority": priority,
                "model": options.get("model") or self._settings.served_model_name,
                **text,
                "sampling": options.get("sampling") or SamplingParams(),
                "reply_to": self.reply_topic,
                "created_at": created,
                **({"batch_id": batch_id} if batch_id is not None else {}),
            }
        )
        key = (tenant, request.request_id)
        if self._reply_reader:
            self.watch(request.request_id, tenant)
            self._created[key] = created
            self._stream_topics[key] = request.reply_to
        value = encode(request)
        headers = self.headers(tenant, options.get("credential"))
        if num_prompt is not None:
            assert self._settings.bus_service_secret is not None
            headers.append(
                (VOUCH_HEADER, vouch(self._settings.bus_service_secret, value, num_prompt))
            )
        context = None
        if self._request_spans and self._reply_reader:
            assert self._tracing is not None
            start_ns = time.time_ns()
            span = start_span(
                self._tracing.tracer,
                "client.request",
                kind=SpanKind.PRODUCER,
                start_time=start_ns,
                attributes=span_attributes(
                    tenant=tenant,
                    request_id=request.request_id,
                    session_id=request.session_id,
                    priority=priority,
                    model=request.model,
                    batch_id=request.batch_id,
                ),
            )
            self._spans[key] = span
            context = with_path(start_ns, set_span_in_context(span))
        inject(headers, context)
        await self._producer.send_and_wait(
            self._topics.requests(priority), value, key=tenant.encode(), headers=headers
        )
        return request

    def reply_sent_ns(self, request: InferenceRequest) -> int | None:
        """Where the request's path to its first token stood when the record of its first
        chunk (seq 0) was sent (its ``tokenbus-path-ns`` header, ``tokenbus.span_path``);
        None before that record, if it carried none, or once asked. Kept apart from the
        stream, which may have ended by then; the newest ``MAX_REPLY_STAMPS`` are kept."""
        return self._reply_sent.pop((_tenant_of(request), request.request_id), None)

    async def cancel(self, request: InferenceRequest, reason: str = "client_cancelled") -> None:
        """Asks the job (if still queued) and every worker (if running) to stop the request.

        The worker that runs it aborts it in the engine and still reports one UsageEvent,
        status ``cancelled``, billed for the tokens generated until then.
        """
        assert self._producer is not None, "call start() first"
        tenant = _tenant_of(request)
        cancel = CancelRequest(request_id=request.request_id, tenant_id=tenant, reason=reason)
        value, key, headers = encode(cancel), tenant.encode(), self.headers(tenant)
        topics = [self._topics.cancels]
        if self._service:
            # A tokenbus service (the bridge) vouches for its cancels: the workers hear
            # them at once, rather than one job hop later. The job still gets one, to
            # drop the request if it waits there.
            topics.append(self._topics.aborts)
        sent = [
            await self._producer.send(topic, value, key=key, headers=headers) for topic in topics
        ]
        await asyncio.gather(*sent)

    def watch(self, request_id: str, tenant_id: str) -> None:
        """Collects chunks of ``tenant_id``'s request sent to this client's reply topic.

        Call it before the request is produced; ``submit`` does so itself.
        """
        if (tenant_id, request_id) not in self._streams:
            if not self._streams and self._lone.idle():
                # One request at a time: its first chunk is the next record here, and
                # it comes soon (tokenbus.tansu.fetch_wait; on the bundled broker only).
                expect_records(self._consumer)
            self._streams[(tenant_id, request_id)] = Inbox()
            self._lone.running(len(self._streams))
            self._watched.set()

    async def stream(self, request: InferenceRequest) -> AsyncIterator[Chunk]:
        """Yields the request's chunks in seq order, ending with the one that has
        finish_reason (``replies``: a redelivered chunk is dropped, missing ones are read
        back from the reply topic, ``client_timeout_s`` of silence raises
        ``TokenbusTimeout``)."""
        replies = self.replies(request)
        try:
            while True:
                chunk = replies.ready() or await replies.next()  # no coroutine if it is here
                yield chunk
                if chunk.is_last:
                    return
        finally:
            replies.close()

    def replies(self, request: InferenceRequest) -> ReplyStream:
        """The request's chunks as a ``ReplyStream``: read with ``next()``, or with
        ``get(timeout_s)``, whose timeout leaves the stream as it was (the bridge waits
        for its heartbeats so). ``close()`` it when done; until then its chunks are
        collected.

        Should chunks go missing (a chunk arrives ahead of its seq, or the stream hears
        nothing for ``client_quiet_s``), the stream reads its reply topic back from the
        request's start (``tokenbus.replies``) and delivers what the reply reader had
        not, logging it, rather than hanging."""
        tenant = _tenant_of(request)
        key = (tenant, request.request_id)
        self.watch(request.request_id, tenant)
        self._stream_topics[key] = request.reply_to

        def forget(replies: ReplyStream) -> None:
            self._streams.pop(key, None)
            self._created.pop(key, None)
            self._stream_topics.pop(key, None)
            span = self._spans.pop(key, None)
            if span is not None:
                last = replies.last
                span.set_attribute("tokenbus.num_chunks", replies.num_delivered)
                if last is None or not last.is_last or last.error is not None:
                    span.set_status(StatusCode.ERROR)
                span.end()

        settings = self._settings
        return ReplyStream(
            request.request_id,
            self._streams[key],
            read_back=functools.partial(self._read_back, request),
            quiet_s=settings.client_quiet_s or settings.client_timeout_s,
            timeout_s=settings.client_timeout_s,
            on_close=forget,
        )

    def _note_reply_sent(self, key: StreamKey, sent_ns: int) -> None:
        stamps = self._reply_sent
        stamps[key] = sent_ns
        if len(stamps) > MAX_REPLY_STAMPS:
            stamps.popitem(last=False)

    async def _read_back(
        self,
        request: InferenceRequest,
        expected: int,
        inbox: Inbox[Chunk],
        ahead: dict[int, Chunk],
    ) -> None:
        """Adds to ``ahead`` what the reply topic holds and the reader had not delivered
        (it may have delivered more while the topic was read: the inbox is drained first,
        so only true misses are logged)."""
        if self._reply_log is None:
            self._reply_log = KafkaReplyLog(self._settings)
        try:
            tenant = _tenant_of(request)
            chunks = await self._reply_log.read(
                reply_to=request.reply_to,
                tenant_id=tenant,
                request_id=request.request_id,
                since=self._created.get((tenant, request.request_id))
                or request.created_at
                or datetime.now(UTC),
            )
        except Exception:
            log.exception("reading back the replies of %s failed", request.request_id)
            return
        while inbox.items:
            chunk = inbox.items.popleft()
            if chunk.seq >= expected:
                ahead.setdefault(chunk.seq, chunk)
        missed = sorted(
            (c for c in chunks if c.seq >= expected and c.seq not in ahead), key=lambda c: c.seq
        )
        if missed:
            log.warning(
                "%s: %d chunks (seq %d..%d) read back from %s: the reply reader had not "
                "delivered them",
                request.request_id,
                len(missed),
                missed[0].seq,
                missed[-1].seq,
                request.reply_to,
            )
        for chunk in missed:
            ahead[chunk.seq] = chunk

    async def _read_replies(self) -> None:
        """Routes chunks to their streams; a failed fetch is logged and retried, never
        left to end the reader (every stream of this client would hang on it)."""
        while True:
            try:
                await self._route_replies()
            except (asyncio.CancelledError, ConsumerStoppedError):
                raise
            except Exception:
                log.exception("reading %s failed; retrying", self.reply_topic)
                await asyncio.sleep(0.2)

    async def _route_replies(self) -> None:
        """One fetch: fans each batch out to its requests' inboxes (``stream`` applies
        the seq rules), and dead-letters each record that is not a good batch."""
        assert self._consumer is not None and self._producer is not None
        streams = self._streams
        if not streams:
            await self._paused_while_idle()
        fetched = await self._consumer.getmany(timeout_ms=1_000)
        for records in fetched.values():
            for record in records:
                try:
                    batch = decode_batch(record.value)
                    tenant_id = batch.tenant_id
                    if record.key != reply_batch_key(tenant_id):
                        raise SchemaError(
                            f"record key {record.key!r} is not the key of the batch's "
                            f"tenant {tenant_id!r}"
                        )
                except SchemaError as exc:
                    await dead_letter_record(
                        publisher(self._producer),
                        self._topics,
                        record,
                        consumer=self.client_id,
                        reason=str(exc),
                    )
                    continue
                if log.isEnabledFor(logging.DEBUG):
                    log.debug(
                        "%s offset %d: %s",
                        record.topic,
                        record.offset,
                        " ".join(f"{c.request_id}#{c.seq}" for c in batch.chunks),
                    )
                sent_ns = path_ns(record.headers) if record.headers else None
                for chunk in batch.chunks:
                    # The batch's tenant is every chunk's (the codec checks): a chunk that
                    # names another tenant's request id never reaches that stream.
                    key = (tenant_id, chunk.request_id)
                    inbox = streams.get(key)
                    if inbox is not None:
                        if sent_ns is not None and chunk.seq == 0:
                            self._note_reply_sent(key, sent_ns)
                        inbox.put(chunk)
        if self._reply_topics.rolls:
            await self._roll()

    async def _paused_while_idle(self) -> None:
        """With no stream open, the reply topic is not fetched until one is watched: an
        idle client (a bridge at night, a program between batches) does not poll the
        broker. A stream is watched before its request is sent, so its replies find the
        fetches going again; a record that came meanwhile (a late chunk of an ended
        stream) is read then, from where the reader left off. Old reply topics are
        still let go of and deleted meanwhile, once a second (``_roll``)."""
        consumer = self._consumer
        assert consumer is not None
        self._watched.clear()
        try:
            while not self._streams:
                consumer.pause(*consumer.assignment())  # a new assignment starts unpaused
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_HOUSEKEEPING_S):
                        await self._watched.wait()
                if self._reply_topics.rolls and not self._streams:
                    await self._roll()
        finally:
            consumer.resume(*consumer.paused())

    async def _roll(self) -> None:
        """Moves new requests to a fresh reply topic once the current one is full, and
        stops reading (and deletes) the old ones no stream reads any more."""
        topics, consumer = self._reply_topics, self._consumer
        assert consumer is not None
        num_records = consumer.highwater(TopicPartition(topics.current, 0)) or 0
        wanted = topics.wants_next(num_records)
        if wanted is not None:
            self._in_background(self._make(wanted))
        moved = topics.switch(num_records)
        if moved:
            log.info("replies to new requests go to %s", topics.current)
        retired = topics.retire(self._stream_topics.values)
        if moved or retired:
            await self._read_from(topics.read)
        if retired:
            self._in_background(delete_topics(self._settings, retired))
        if again := topics.delete_again():
            self._in_background(delete_topics(self._settings, again))

    async def _make(self, topic: str) -> None:
        try:
            await ensure_topics(self._settings, {topic: 1})
        except Exception:
            log.warning("could not create reply topic %s; will try again", topic, exc_info=True)
            self._reply_topics.not_ready(topic)
        else:
            self._reply_topics.ready(topic)

    async def _read_from(self, topics: list[str]) -> None:
        """Reads ``topics`` from here on: each one read before from where it was, a new
        one from its start."""
        consumer = self._consumer
        assert consumer is not None
        positions = {tp: await consumer.position(tp) for tp in consumer.assignment()}
        wanted = [TopicPartition(topic, 0) for topic in topics]
        consumer.assign(wanted)
        for tp in wanted:
            consumer.seek(tp, positions.get(tp, 0))

    def _in_background(self, work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(work)
        self._housekeeping.add(task)
        task.add_done_callback(self._housekeeping.discard)


MAX_REPLY_STAMPS = 4096
"""First-chunk stamps kept for ``reply_sent_ns`` (those nobody asks for are let go)."""
IDLE_HOUSEKEEPING_S = 1.0
"""How often an idle client's paused reader lets go of and deletes old reply topics."""


def _tenant_of(request: InferenceRequest) -> str:
    assert request.tenant_id is not None, "submit always names the tenant"
    return request.tenant_id


def _service_credential(secret: str) -> Callable[[str, str], str]:
    from tokenbus.auth import ServiceTokens  # PyJWT: the stream environment only

    return ServiceTokens(secret).token
