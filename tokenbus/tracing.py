"""Traces across the bus: W3C trace context in Kafka headers, spans out through OTLP or
through tokenbus's own span topic.

# a record's ``traceparent``/``tracestate`` headers <--> inject() / extract()
# a service's spans --> OpenTelemetry SDK (parent-based ratio sampler)
#   --> OTLP/HTTP, when ``TOKENBUS_OTLP_ENDPOINT`` is set
#   --> otherwise SpanBuffer --> flush(): one SpanBatch per tenant --> <prefix>.spans,
#       keyed by tenant --> billing's span sink --> ClickHouse ``spans`` --> ``tokenbus trace``

Every service builds one ``Tracing`` at start and hands its ``tracer`` to the code that
opens spans. A request's spans carry the ``ATTR_*`` attributes, with the tenant the
credential proved (never a producer's word for it). A producer's ``traceparent`` header
is honoured as a parent and nothing more: it names a trace id, so a producer can file its
request under a trace of its own choosing, but ``tokenbus trace`` reads a tenant's spans
only, so no tenant can reach into another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping, MutableSequence, Sequence

import orjson
from opentelemetry.context import Context, create_key, get_value, set_value
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    Tracer,
    get_current_span,
    set_span_in_context,
)

from schemas import WorkItem
from tokenbus.config import Settings
from tokenbus.kafka import Publish
from tokenbus.sampling import ParentBasedRatio
from tokenbus.span_buffer import TENANT_ATTRIBUTE, SpanBuffer
from tokenbus.span_path import PATH_HEADER
from tokenbus.topics import Topics
from tokenbus.traceparent import (
    MAX_TRACESTATE_LENGTH,
    TRACEPARENT,
    TRACESTATE,
    format_traceparent,
    parse_traceparent,
)

log = logging.getLogger(__name__)

ATTR_TENANT = TENANT_ATTRIBUTE  # the span buffer files spans under it
ATTR_SESSION = "tokenbus.session_id"
ATTR_REQUEST = "tokenbus.request_id"
ATTR_ATTEMPT = "tokenbus.attempt"
ATTR_PRIORITY = "tokenbus.priority"
ATTR_MODEL = "tokenbus.model"
ATTR_WORKER = "tokenbus.worker"
ATTR_BATCH = "tokenbus.batch_id"
ATTR_PROMPT_TOKENS = "tokenbus.num_prompt_tokens"
ATTR_COMPLETION_TOKENS = "tokenbus.num_completion_tokens"
ATTR_CACHED_TOKENS = "tokenbus.num_cached_tokens"
ATTR_OUTCOME = "tokenbus.outcome"

Headers = MutableSequence[tuple[str, bytes]]

_PATH_KEY = create_key("tokenbus-path-ns")


def with_path(ns: int, context: Context | None = None) -> Context:
    """``context`` (or the current one) with where the request's path to its first
    token stands (``tokenbus.span_path``): ``inject`` hands it on in the headers."""
    return set_value(_PATH_KEY, ns, context)


def inject(headers: Headers, context: Context | None = None) -> None:
    """Writes the current (or ``context``'s) span as ``traceparent``/``tracestate``
    headers, replacing any already there, and the path's instant (``with_path``) as
    ``tokenbus-path-ns``. Nothing is written without a valid span."""
    span_context = get_current_span(context).get_span_context()
    traceparent = format_traceparent(span_context)
    if traceparent is not None:
        _set_header(headers, TRACEPARENT, traceparent)
        if span_context.trace_state:
            _set_header(headers, TRACESTATE, span_context.trace_state.to_header())
    ns = get_value(_PATH_KEY, context)
    if isinstance(ns, int) and (
        traceparent is not None or any(k == TRACEPARENT for k, _ in headers)
    ):
        _set_header(headers, PATH_HEADER, str(ns))


def _set_header(headers: Headers, key: str, value: str) -> None:
    if any(k == key for k, _ in headers):
        headers[:] = [(k, v) for k, v in headers if k != key]
    headers.append((key, value.encode()))


def extract(headers: Sequence[tuple[str, bytes]] | None) -> Context:
    """The trace context a record's headers carry; an empty context when they carry none
    or a malformed one (the W3C parser refuses it), so the span opened under it starts a
    trace of its own."""
    traceparent: str | None = None
    tracestates: list[str] | None = None
    length = 0
    # In one pass, keeping no more than the parser reads: a record with tens of thousands
    # of headers (a producer can send them) costs time in proportion, and no more.
    for key, value in headers or ():
        if value is None:
            continue
        if key == TRACEPARENT:
            if traceparent is None:  # the parser reads the first
                traceparent = value.decode("latin-1")
        elif key == TRACESTATE:
            if tracestates is None:
                tracestates = []
            if length <= MAX_TRACESTATE_LENGTH:  # past it, the parser drops the state
                state = value.decode("latin-1")
                tracestates.append(state)
                length += len(state) + 1
    traceparents = None if traceparent is None else [traceparent]
    return _context_of(parse_traceparent(traceparents, tracestates))


def extract_http(headers: Mapping[str, str]) -> Context:
    """``extract`` for an HTTP request's headers (a W3C ``traceparent`` from the caller),
    each header's first value as Starlette's ``Headers.get`` gives it."""
    return _context_of(
        parse_traceparent(_values(headers.get(TRACEPARENT)), _values(headers.get(TRACESTATE)))
    )


def _values(value: str | Iterable[str] | None) -> list[str] | None:
    """A header's values as the propagator's default getter lists them."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    return list(value)


def _context_of(span_context: SpanContext | None) -> Context:
    if span_context is None:
        return Context()
    return set_span_in_context(NonRecordingSpan(span_context), Context())


class Tracing:
    """One service's tracer and where its spans go."""

    def __init__(
        self, settings: Settings, service: str, *, exporter: SpanExporter | None = None
    ) -> None:
        self.service = f"tokenbus-{service}"
        self._topics = Topics(settings.topic_prefix)
        self._interval_s = settings.trace_flush_interval_s
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": self.service}),
            sampler=ParentBasedRatio(settings.trace_sample_ratio),
        )
        if exporter is None and settings.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=f"{settings.otlp_endpoint}/v1/traces")
        self.buffer: SpanBuffer | None = None
        if exporter is not None:
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        else:
            self.buffer = SpanBuffer(self.service)
            self.provider.add_span_processor(self.buffer)
        self.tracer: Tracer = self.provider.get_tracer("tokenbus")
        self.num_sent = 0

    async def flush(self, publish: Publish) -> int:
        """Sends the buffered spans, one record per tenant; returns how many spans.
        A batch the broker refuses is logged and dropped: traces are best effort and
        never hold up the service."""
        if self.buffer is None:
            return 0
        num_spans = 0
        for tenant, spans in self.buffer.take().items():
            value = orjson.dumps({"schema_version": 1, "tenant_id": tenant, "spans": spans})
            try:
                await publish(self._topics.spans, tenant.encode(), value)
            except Exception as exc:
                log.warning("dropped %d spans of %s: %s", len(spans), tenant, exc)
                continue
            num_spans += len(spans)
        self.num_sent += num_spans
        return num_spans

    async def run(self, publish: Publish, stop: asyncio.Event) -> None:
        """Flushes every ``trace_flush_interval_s`` until ``stop``, then once more."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self._interval_s)
            await self.flush(publish)

    def shutdown(self) -> None:
        self.provider.shutdown()


def span_attributes(
    *,
    tenant: str,
    request_id: str,
    session_id: str | None = None,
    attempt: int | None = None,
    priority: int | None = None,
    model: str | None = None,
    worker: str | None = None,
    batch_id: str | None = None,
) -> dict[str, str | int]:
    """A request's span attributes, with what is known left in."""
    pairs: Iterable[tuple[str, str | int | None]] = (
        (ATTR_TENANT, tenant),
        (ATTR_REQUEST, request_id),
        (ATTR_SESSION, session_id),
        (ATTR_ATTEMPT, attempt),
        (ATTR_PRIORITY, priority),
        (ATTR_MODEL, model),
        (ATTR_WORKER, worker),
        (ATTR_BATCH, batch_id),
    )
    return {k: v for k, v in pairs if v is not None}


def work_item_attributes(
    item: WorkItem, *, attempt: int | None = None, worker: str | None = None
) -> dict[str, str | int]:
    """``span_attributes`` of a work item (tenant, request, session, class, model, batch),
    with its attempt and worker where the span speaks of them."""
    return span_attributes(
        tenant=item.tenant_id,
        request_id=item.request_id,
        session_id=item.session_id,
        attempt=attempt,
        priority=item.priority,
        model=item.requested_model,
        worker=worker,
        batch_id=item.batch_id,
    )


def token_attributes(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, int]:
    """A finished request's token counts, as its span attributes."""
    return {
        ATTR_PROMPT_TOKENS: num_prompt,
        ATTR_COMPLETION_TOKENS: num_completion,
        ATTR_CACHED_TOKENS: num_cached,
    }
