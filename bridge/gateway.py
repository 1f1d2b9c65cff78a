"""The HTTP handlers' shell: read, call the policies, produce, relay. Little logic lives here.

# Authorization --> Authenticator --> Caller (tenant config narrowed by claims)
# credential --> KeyThrottle (429) ; body --> deadline (408), size limit (413) --> parse (400)
# body + Caller --> Planner --> Plan (403 / 413 / 400 / 429, flags)
# Plan + a service token for the Caller's tenant --> TokenbusClient.submit
# --> TokenbusClient.replies (ReplyStream) --> Relay --> JSON or SSE events
# disconnect, or giving up on the bus --> TokenbusClient.cancel

A request's HTTP status waits for its first chunk (at most ``bridge_first_chunk_wait_s``
when streaming), so a refusal by the job (quota, no worker) is a real 429 or 503. Once
events have started, an error is a final SSE error event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, Protocol, TypeVar, Unpack

from aiokafka.errors import MessageSizeTooLargeError
from opentelemetry import context as otel_context
from opentelemetry import trace
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from bridge.admission import Plan, Planner
from bridge.auth import Authenticator, Caller
from bridge.errors import (
    ApiError,
    invalid_request,
    rate_limit_headers,
    rate_limited,
    rejection,
    request_timeout,
    too_large,
)
from bridge.metrics import BridgeMetrics
from bridge.relay import DONE, HEARTBEAT, Kind, Relay, sse_error
from bridge.sessions import SessionIssuer
from bridge.sse import EventStreamResponse, WriteClock
from bridge.throttle import KeyThrottle
from producers import ReplyStream, SubmitOptions, TokenbusTimeout
from schemas import ErrorInfo, InferenceRequest
from schemas.openai_api import ChatCompletionRequest, CompletionRequest
from tokenbus.auth import ServiceTokens
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus.finished_span import end_span
from tokenbus.ids import new_request_id
from tokenbus.lean_span import start_span
from tokenbus.logs import bind_request
from tokenbus.span_path import REQUEST_START_HEADER, SpanPath, hop_span, request_start_ns
from tokenbus.tracing import ATTR_TENANT, extract_http, span_attributes, with_path

log = logging.getLogger(__name__)
B = TypeVar("B", bound=BaseModel)
T = TypeVar("T")
_MAX_EVENTS_PER_WRITE = 256
"""The most SSE events the bridge joins into one write (what a stream holds at once)."""
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class ClientGone(Exception):
    """The client disconnected before its response began; the request was cancelled."""


class Bus(Protocol):
    """What the gateway needs of ``producers.TokenbusClient``."""

    @property
    def reply_topic(self) -> str:
        """Where the replies of the requests it submits now go."""

    @property
    def reply_prefix(self) -> str:
        """Its reply topics, as a token names them (``Principal.owns_reply_topic``)."""

    async def submit(
        self,
        *,
        tenant_id: str,
        **options: Unpack[SubmitOptions],
    ) -> InferenceRequest: ...

    def replies(self, request: InferenceRequest) -> ReplyStream:
        """The request's chunks, read with a timeout that leaves the stream as it was.
        Its tenant's only: the client files a chunk under the tenant of its batch."""

    def reply_sent_ns(self, request: InferenceRequest) -> int | None:
        """Where the path of ``request`` stood when its first reply record was sent
        (``tokenbus.span_path``), once that record was read; None if it carried none."""

    async def cancel(self, request: InferenceRequest, reason: str = ...) -> None: ...


def ids_of(http: Request) -> dict[str, str]:
    return dict(getattr(http.state, "ids", {}))


class Gateway:
    def __init__(
        self,
        settings: Settings,
        bus: Bus,
        authenticator: Authenticator,
        throttle: KeyThrottle,
        sessions: SessionIssuer,
        planner: Planner,
        metrics: BridgeMetrics,
        tokens: ServiceTokens,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self._tracer = tracer or trace.NoOpTracer()
        self._settings = settings
        self._bus = bus
        self._auth = authenticator
        self._throttle = throttle
        self._sessions = sessions
        self._planner = planner
        self._metrics = metrics
        self._tokens = tokens

    # -- shared steps ---------------------------------------------------------------------
    def authenticate(self, http: Request) -> Caller:
        caller = self._auth.authenticate(http.headers.get("authorization"))
        # Session and request IDs are fixed now, so every later answer carries them.
        http.state.ids = {
            "X-Session-ID": self._sessions.resolve(
                http.headers.get("x-session-id"), caller.tenant.tenant_id
            ),
            "X-Request-ID": new_request_id(),
        }
        decision = self._throttle.take(caller.credential_id, time.monotonic())
        if not decision.allowed:
            raise rate_limited(
                f"More than {self._settings.bridge_key_rate_per_s:g} requests per second "
                "with this key.",
                "rate_limit_exceeded",
                rate_limit_headers(
                    kind="requests",
                    limit=decision.limit,
                    remaining=decision.remaining,
                    reset_s=decision.retry_after_s,
                ),
            )
        return caller

    async def read_body(self, http: Request, model: type[B]) -> B:
        limit = self._settings.bridge_max_body_bytes
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(f"The body exceeds {limit} bytes.", None, "body_too_large")
        timeout_s = self._settings.bridge_body_read_timeout_s
        raw = await read_within(http, _read_raw(http, limit), timeout_s, "the body")
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise _invalid_body(exc) from None

    # -- endpoints ------------------------------------------------------------------------
    async def chat_completions(self, http: Request) -> Response:
        return await self._traced(http, "chat")

    async def completions(self, http: Request) -> Response:
        return await self._traced(http, "text")

    async def _traced(self, http: Request, kind: Kind) -> Response:
        """One completion under a ``bridge.request`` span, the caller's ``traceparent``
        its parent, with auth, hygiene, the wait for admission and the relay as its
        children. A streamed answer ends the span when its last event is out.

        Up to the first event the children tile the request's time (``SpanPath``):
        [``bridge.arrival``, from a front end's ``X-Request-Start``,] ``bridge.auth``,
        ``bridge.hygiene``, ``bridge.admission_wait``, ``bridge.first_event``."""
        tracer = self._tracer
        received = getattr(http.state, "received_ns", None) or time.time_ns()
        arrived = request_start_ns(http.headers.get(REQUEST_START_HEADER), received)
        span = start_span(
            tracer,
            "bridge.request",
            context=extract_http(http.headers),
            kind=trace.SpanKind.SERVER,
            start_time=arrived or received,  # as the front end, or the server, had it
        )
        # For the rest of this request's task, the streamed relay included.
        otel_context.attach(trace.set_span_in_context(span))
        path = SpanPath(tracer, received)
        try:
            with path.step("bridge.auth") as auth:
                caller = self.authenticate(http)
                tenant = {ATTR_TENANT: caller.tenant.tenant_id}
                auth.set_attributes(tenant)
            if arrived is not None:
                # Before auth on the path; made now, when its tenant (its filing) is known.
                end_span(tracer, "bridge.arrival", arrived, received, tenant)
            ids = ids_of(http)
            span.set_attributes(
                span_attributes(
                    tenant=caller.tenant.tenant_id,
                    request_id=ids["X-Request-ID"],
                    session_id=ids["X-Session-ID"],
                )
            )
            with path.step("bridge.hygiene", attributes=tenant):
                if kind == "chat":
                    chat = await self.read_body(http, ChatCompletionRequest)
                    plan = self._planner.plan_chat(chat, caller)
                else:
                    text = await self.read_body(http, CompletionRequest)
                    plan = self._planner.plan_completion(text, caller)
            response = await self._complete(http, caller, plan, kind, span, path)
        except BaseException as exc:
            span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200])
            span.end()
            raise
        return response

    # -- one completion -------------------------------------------------------------------
    async def _complete(
        self,
        http: Request,
        caller: Caller,
        plan: Plan,
        kind: Kind,
        span: trace.Span,
        path: SpanPath,
    ) -> Response:
        ids = ids_of(http)
        for flag in plan.flags:
            self._metrics.flags.labels(flag).inc()
        received = time.monotonic()
        labels = self._metrics.labels(caller.tenant.tenant_id, plan.model, plan.priority)
        # The job believes this token for the tenant authenticated here, with its
        # narrowed class, models and balance, and the flags the screening raised.
        credential = self._tokens.token(
            caller.tenant.tenant_id,
            self._bus.reply_prefix,
            narrowed=caller.tenant,
            quota_balance=caller.quota_balance,
            flags=tuple(plan.flags),
            key_sha256=caller.key_sha256,
        )
        tenant = {ATTR_TENANT: caller.tenant.tenant_id}
        # From submit to the first chunk: the bus, the job's admission and queue, the
        # engine's prefill. The request carries this span, and where the path stands, to
        # the job: the spans of the bus, the job and the worker tile this one.
        waiting = path.begin("bridge.admission_wait", attributes=tenant)
        submitting = otel_context.attach(with_path(path.at, trace.set_span_in_context(waiting)))
        try:
            try:
                request = await self._bus.submit(
                    tenant_id=caller.tenant.tenant_id,
                    prompt=plan.prompt,
                    messages=plan.messages,
                    model=plan.model,
                    priority=plan.priority,
                    sampling=plan.sampling,
                    session_id=ids["X-Session-ID"],
                    request_id=ids["X-Request-ID"],
                    credential=credential,
                    # The job takes this count rather than tokenize the prompt again
                    # (tokenbus.prompt_vouch); an estimate it makes for itself.
                    num_prompt_tokens=plan.num_prompt_tokens if plan.prompt_tokens_exact else None,
                )
            finally:
                otel_context.detach(submitting)
        except MessageSizeTooLargeError:
            path.end(waiting)
            raise too_large(
                "The request is larger than a bus record may be; send a shorter prompt.",
                None,
                "request_too_large",
            ) from None
        except BaseException:
            path.end(waiting)
            raise
        bind_request(
            tenant=caller.tenant.tenant_id,
            request_id=request.request_id,
            session_id=request.session_id,
        )
        replies = self._bus.replies(request)
        relay = Relay(kind, request.request_id, plan.model, plan.num_prompt_tokens)
        try:
            wait = self._settings.bridge_first_chunk_wait_s if plan.stream else None
            first = await self._next_chunk(http, replies, request, wait, labels)
        except BaseException:
            replies.close()
            path.end(waiting)
            raise
        self._reply_hop(request, waiting, path.end(waiting), tenant)
        if first is not None:
            self._metrics.ttft.labels(*labels).observe(time.monotonic() - received)
            if first.error is not None:
                replies.close()
                self._outcome(labels, first.error.code)
                raise rejection(first.error, tokens_per_minute=caller.tenant.tpm)
        relaying = start_span(self._tracer, "bridge.relay", attributes=tenant)
        if plan.stream:
            # The first chunk is here: until its event is written to the client.
            first_event = path.begin("bridge.first_event", attributes=tenant)
            clock = WriteClock()
            return EventStreamResponse(
                self._events(
                    replies,
                    relay,
                    request,
                    first,
                    plan.include_usage,
                    caller,
                    (relaying, span),
                    labels=labels,
                    first_event=first_event,
                    clock=clock,
                ),
                headers=ids,
                on_disconnect=lambda: self._cancel(request, "client_disconnected"),
                clock=clock,
            )
        try:
            body = await self._collect(http, replies, relay, request, first, caller, labels)
        finally:
            replies.close()
            relaying.end()
        span.end()
        return JSONResponse(body, headers=ids)

    def _reply_hop(
        self, request: InferenceRequest, waiting: trace.Span, taken_ns: int, tenant: dict[str, str]
    ) -> None:
        """``bus.reply``: the first reply record's way from the worker to this handler,
        the last span of the admission wait's path."""
        sent = self._bus.reply_sent_ns(request)
        if sent is not None:  # (``waiting`` has ended: its context is the parent's)
            context = trace.set_span_in_context(waiting)
            hop_span(self._tracer, "bus.reply", sent, taken_ns, tenant, context=context)

    async def _next_chunk(
        self,
        http: Request,
        replies: ReplyStream,
        request: InferenceRequest,
        wait_s: float | None,
        labels: tuple[str, str, str],
    ) -> Chunk | None:
        """The stream's next chunk (None if ``wait_s`` passes first); the client's timeout
        cancels the request and answers ``timeout``."""
        try:
            return await self._until_disconnect(http, replies.get(wait_s), request)
        except TokenbusTimeout as exc:
            self._outcome(labels, "timeout")
            await self._cancel(request, "bridge_timeout")
            raise rejection(
                ErrorInfo(code="timeout", message=str(exc)), tokens_per_minute=0
            ) from None

    async def _collect(
        self,
        http: Request,
        replies: ReplyStream,
        relay: Relay,
        request: InferenceRequest,
        chunk: Chunk | None,
        caller: Caller,
        labels: tuple[str, str, str],
    ) -> dict[str, Any]:
        first_at = time.monotonic()
        first_tokens = chunk.num_tokens if chunk is not None else 0
        while True:
            if chunk is None:
                chunk = await self._next_chunk(http, replies, request, None, labels)
                assert chunk is not None  # no wait was given
            relay.add(chunk)
            if chunk.error is not None:
                self._outcome(labels, chunk.error.code)
                raise rejection(chunk.error, tokens_per_minute=caller.tenant.tpm)
            if chunk.is_last:
                self._metrics.tokens_relayed.labels(labels[0]).inc(relay.num_completion_tokens)
                self._finished(labels, first_at, relay.num_completion_tokens - first_tokens)
                return relay.response().model_dump(mode="json")
            chunk = None

    async def _until_disconnect(
        self, http: Request, read: Any, request: InferenceRequest
    ) -> Chunk | None:
        """Awaits ``read``; if the client leaves first, cancels the request on the bus."""
        reading: asyncio.Task[Chunk | None] = asyncio.ensure_future(read)
        leaving = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({reading, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
        if not reading.done():
            reading.cancel()
            await self._cancel(request, "client_disconnected")
            raise ClientGone(request.request_id)
        return reading.result()

    async def _events(
        self,
        replies: ReplyStream,
        relay: Relay,
        request: InferenceRequest,
        chunk: Chunk | None,
        include_usage: bool,
        caller: Caller,
        spans: tuple[trace.Span, ...] = (),
        *,
        labels: tuple[str, str, str],
        first_event: trace.Span | None = None,
        clock: WriteClock | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The stream's SSE events. What the stream already holds goes out in one write:
        a client that fell behind (a burst of reply records, a busy bridge) costs one
        ASGI send for the burst, not one per token; a client that keeps up gets each
        event as its chunk arrives.

        ``spans`` end with the stream, however it ends; ``first_event`` once the first
        event is written (the response resumes this generator after each send), at the
        instant the response began writing it (``clock``)."""
        relayed = self._metrics.tokens_relayed.labels(labels[0])
        first_at = time.monotonic()
        first_tokens = chunk.num_tokens if chunk is not None else 0
        self._metrics.active_streams.inc()
        gathered: list[bytes] = []  # events of the chunks at hand, not yet written
        num_tokens = 0  # their tokens

        def written() -> None:  # events were sent: the first one among them, if still open
            nonlocal first_event
            if first_event is not None:
                first_event.end(end_time=(clock.writing_ns if clock is not None else 0) or None)
                first_event = None

        try:
            while True:
                if chunk is None:
                    if gathered:  # nothing more at hand: write what is
                        yield b"".join(gathered)
                        gathered.clear()
                        relayed.inc(num_tokens)
                        num_tokens = 0
                        written()
                    try:
                        chunk = await replies.get(self._settings.bridge_heartbeat_s)
                    except Exception as exc:  # the headers are out: end with an error event
                        await self._cancel(request, "bridge_timeout")
                        if isinstance(exc, TokenbusTimeout):
                            info = ErrorInfo(code="timeout", message=str(exc))
                        else:
                            log.exception("stream of %s failed", request.request_id)
                            info = ErrorInfo(code="bus_error", message="The stream broke off.")
                        self._outcome(labels, info.code)
                        yield sse_error(rejection(info, tokens_per_minute=0))
                        yield DONE
                        return
                    if chunk is None:
                        yield HEARTBEAT  # a quiet stream stays open through proxies
                        continue
                relay.add(chunk)
                if chunk.error is not None:
                    self._outcome(labels, chunk.error.code)
                    relayed.inc(num_tokens)
                    error = sse_error(rejection(chunk.error, tokens_per_minute=caller.tenant.tpm))
                    yield b"".join([*gathered, error])
                    if gathered:
                        written()
                    yield DONE
                    return
                event = relay.event(chunk)
                if event is not None:
                    gathered.append(event)
                num_tokens += chunk.num_tokens
                if chunk.is_last:
                    relayed.inc(num_tokens)
                    self._finished(labels, first_at, relay.num_completion_tokens - first_tokens)
                    if gathered:
                        yield b"".join(gathered)
                        written()
                    if include_usage:
                        yield relay.usage_event()
                    yield DONE
                    return
                chunk = replies.ready() if len(gathered) < _MAX_EVENTS_PER_WRITE else None
        finally:
            self._metrics.active_streams.dec()
            replies.close()
            for span in (*spans, *([first_event] if first_event is not None else [])):
                span.end()

    def _outcome(self, labels: tuple[str, str, str], code: str) -> None:
        self._metrics.completions.labels(*labels, code).inc()

    def _finished(self, labels: tuple[str, str, str], first_at: float, num_after: int) -> None:
        """A completed response: counted ``ok``, and its mean gap between tokens after
        the first chunk observed once (nothing per token)."""
        self._outcome(labels, "ok")
        if num_after > 0:
            self._metrics.itl.labels(*labels).observe((time.monotonic() - first_at) / num_after)

    async def _cancel(self, request: InferenceRequest, reason: str) -> None:
        log.info("cancelling %s: %s", request.request_id, reason)
        self._metrics.cancels.labels(reason).inc()
        try:
            await self._bus.cancel(request, reason)
        except Exception:
            log.exception("could not cancel %s on the bus", request.request_id)


async def _read_raw(http: Request, limit: int) -> bytes:
    raw = bytearray()
    async for part in http.stream():
        raw += part
        if len(raw) > limit:
            raise too_large(f"The body exceeds {limit} bytes.", None, "body_too_large")
    return bytes(raw)


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _invalid_body(exc: ValidationError) -> ApiError:
    error = exc.errors(include_url=False)[0]
    param = _param(error["loc"])
    kind = error["type"]
    if kind == "json_invalid":
        return invalid_request("The body is not valid JSON.", None, code="invalid_json")
    if kind == "extra_forbidden":
        return invalid_request(
            f"Unrecognized request argument supplied: {param}", param, code="unknown_parameter"
        )
    if kind == "missing":
        return invalid_request(f"Missing required parameter: {param}", param, "missing_required")
    where = f"'{param}'" if param else "the body"
    return invalid_request(f"Invalid value for {where}: {error['msg']}", param)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """pydantic's error location as a field path (``messages[0].content``), without the
    union-member tags pydantic inserts (``str``, ``list[TextPart]``...)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part.lower() not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or None


async def read_within(http: Request, read: Awaitable[T], timeout_s: float, what: str) -> T:
    """``read`` of a request's body under one deadline for all of it (a byte now and then
    does not extend it): 408 with ``Connection: close`` past it, ``ClientGone`` if the
    client leaves meanwhile. ``what`` names the body in the log."""
    request_id = ids_of(http).get("X-Request-ID", "-")
    try:
        async with asyncio.timeout(timeout_s):
            return await read
    except TimeoutError:
        log.info("%s: %s did not arrive within %g s", request_id, what, timeout_s)
        raise request_timeout(timeout_s) from None
    except ClientDisconnect:
        log.info("%s: the client closed while sending %s", request_id, what)
        raise ClientGone(request_id) from None
