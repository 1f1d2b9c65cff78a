"""A live span of the SDK's own class, made without the SDK's per-span bookkeeping.

# (name, start, attributes, parent context) --> the tracer's sampler and id generator
#   --> sampled, and the tracer's one processor a ``SpanBuffer``: ``BufferedSpan``
#       (what the buffer files, and nothing else) --> at ``end``: ``SpanBuffer.record``
#   --> else: LeanSpan (the SDK's ``Span``, attributes a plain dict while they are
#       scalars) --> at ``end``: the processors' ``on_end``, as the SDK's ``ReadableSpan``

A request's live spans (the bridge's request and path steps, the job's admission and
queue, the worker's request) set a few scalar attributes and end. Through
``Tracer.start_span`` each one's attributes go through the SDK's validating, locked
mapping (``BoundedAttributes``, an ABC ``isinstance`` chain per value), twice: at start
and again for each ``set_attribute``; that was a fifth of tracing's work per request.
``start_span`` decides and names the span as ``Tracer.start_span`` does (the tracer's
sampler, its id generator, the parent's random-trace-id flag, its resource, scope and
span limits, the SDK's own span metrics when they are on). Its attributes are kept as a
plain dict while every key is a non-empty ``str``, every value a ``str``, ``bool``,
``int`` or ``float``, and the span's limits leave them as they are; the first attribute
that is not goes into the SDK's ``BoundedAttributes`` with all the others, so what it
keeps and drops is the SDK's decision.

When the tracer's sampler is ``ParentBasedRatio`` and its one processor the
``SpanBuffer`` (``finished_span.lone_buffer``: every tokenbus service without an OTLP
endpoint), nothing but that buffer reads a span, and it files a span's ids, name,
times, status and scalar attributes only. A sampled span is then a ``BufferedSpan``:
those fields, the SDK's rules for them (status, renames, limits, calls on an ended
span), and no resource, scope, events, links or ``on_start``, which the SDK's
``ReadableSpan`` would carry to the buffer only to be left out. It halved what tracing
costs the job's own code per admitted request (``bench.admit_work``: 47 µs to 27 on the
development VM). Otherwise (an exporter, another processor, another sampler) the span
is a ``LeanSpan``: the SDK's ``Span``, whose status, events, exceptions and context
manager are the SDK's own, with its attributes kept as above and its event and link
lists made at the first. A tracer other than the SDK's, or one its configurator
disabled, goes through its own ``start_span``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from time import time_ns
from types import TracebackType

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    TraceState,
    get_current_span,
)
from opentelemetry.util import types

from tokenbus.finished_span import lone_buffer, new_span_context
from tokenbus.span_buffer import SpanBuffer, status_name

log = logging.getLogger(__name__)

_SCALARS = frozenset({str, bool, int, float})
_KEYS = frozenset({str})


class _PlainAttributes:
    """A span's attributes as a plain dict while every key is a non-empty ``str``, every
    value a ``str``, ``bool``, ``int`` or ``float``, and the span's limits leave them as
    they are; from the first that is not, the SDK's ``BoundedAttributes`` with them all."""

    _attributes: dict[str, types.AttributeValue] | BoundedAttributes
    _limits: sdk_trace.SpanLimits
    _lock: threading.Lock
    _end_time: int | None

    def _put(self, attributes: Mapping[str, types.AnyValue]) -> None:
        """Sets ``attributes`` as ``BoundedAttributes._set_items`` would: in the plain
        dict while they are plain scalars under plain keys within the limits (a key set
        again moves to the end, as there), otherwise, from then on, in the SDK's
        ``BoundedAttributes`` with the ones set before."""
        plain = self._attributes
        if type(plain) is dict and self._plain(plain, attributes):
            if not plain.keys().isdisjoint(attributes.keys()):
                for key in attributes:
                    plain.pop(key, None)
            plain.update(attributes)  # type: ignore[arg-type]
            return
        self._bounded()._set_items(attributes)

    def _plain(
        self, plain: dict[str, types.AttributeValue], attributes: Mapping[str, types.AnyValue]
    ) -> bool:
        limits = self._limits
        maxlen = limits.max_span_attributes
        return (
            limits.max_span_attribute_length is None
            and (
                maxlen is None
                or len(plain) + len(attributes) <= maxlen
                or len(plain.keys() | attributes.keys()) <= maxlen
            )
            and "" not in attributes
            and _KEYS.issuperset(map(type, attributes.keys()))
            and _SCALARS.issuperset(map(type, attributes.values()))
        )

    def _bounded(self) -> BoundedAttributes:
        """The attributes in the SDK's mapping, as ``Span.__init__`` would have made it."""
        if type(self._attributes) is dict:
            limits = self._limits
            self._attributes = BoundedAttributes(
                limits.max_span_attributes,
                self._attributes,
                immutable=False,
                max_value_len=limits.max_span_attribute_length,
            )
        return self._attributes  # type: ignore[return-value]

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        with self._lock:
            if self._end_time is not None:
                log.warning("Setting attribute on ended span.")
                return
            self._put(attributes)

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        with self._lock:
            if self._end_time is not None:
                log.warning("Setting attribute on ended span.")
                return
            pair = {key: value}
            plain = self._attributes
            if type(plain) is dict and self._plain(plain, pair):
                plain.pop(key, None)
                plain[key] = value  # type: ignore[assignment]
                return
            self._bounded()[key] = value


class LeanSpan(_PlainAttributes, sdk_trace.Span):  # type: ignore[misc]  # a plain dict too
    """The SDK's ``Span`` whose attributes stay a plain dict while they are plain
    scalars within the span's limits (``start_span`` makes it)."""

    def __init__(
        self,
        tracer: sdk_trace.Tracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: Mapping[str, types.AttributeValue] | None,
        kind: SpanKind,
    ) -> None:
        # ReadableSpan's fields and the SDK Span's own, as ``Span.__init__`` sets them,
        # less the attributes' validating mapping while it is not needed.
        sdk_trace.ReadableSpan.__init__(
            self,
            name,
            context=context,
            parent=parent,
            resource=tracer.resource,
            kind=kind,
            instrumentation_info=tracer.instrumentation_info,
            instrumentation_scope=tracer._instrumentation_scope,
        )
        self._sampler = tracer.sampler
        self._trace_config = None
        self._record_exception = True
        self._set_status_on_exception = True
        self._span_processor = tracer.span_processor
        self._limits = tracer._span_limits
        self._lock = threading.Lock()
        # The SDK's bounded lists, made at the first event or link (most spans have none).
        self._events = ()
        self._links = ()
        self._record_end_metrics = None
        self._attributes = {}
        if attributes:
            self._put(attributes)

    def _add_event(self, event: sdk_trace.EventBase) -> None:
        with self._lock:
            if self._end_time is None:
                if not isinstance(self._events, BoundedList):
                    self._events = BoundedList(self._limits.max_events)
                self._events.append(event)  # type: ignore[arg-type]
                return
        log.warning("Tried calling %s on an ended span.", "_add_event")

    def _add_link(self, link: Link) -> None:
        with self._lock:
            if self._end_time is None:
                if not isinstance(self._links, BoundedList):
                    self._links = BoundedList(self._limits.max_links)
                self._links.append(link)
                return
        log.warning("Tried calling %s on an ended span.", "_add_link")

    def end(self, end_time: int | None = None) -> None:
        with self._lock:
            if self._start_time is None:
                raise RuntimeError("Calling end() on a not started span.")
            if self._end_time is not None:
                log.warning("Calling end() on an ended span.")
                return
            self._end_time = end_time if end_time is not None else time_ns()
            attributes = self._attributes
            if type(attributes) is not dict:
                attributes._immutable = True  # type: ignore[union-attr]
        if self._record_end_metrics:
            self._record_end_metrics()
        self._span_processor._on_ending(self)
        self._span_processor.on_end(self._readable_span())


class BufferedSpan(_PlainAttributes, Span):
    """A sampled live span whose one reader is the tracer's lone ``SpanBuffer``: only
    what the buffer files is kept (name, ids, times, status, scalar attributes), and
    ``end`` hands it over. The SDK's span would also keep events, links and its kind,
    resource and scope, which that buffer never reads; so an exception recorded on it
    files nothing more, as with the SDK's span. Its status, name, attributes and their
    limits, and its warnings on an ended span are the SDK's rules."""

    def __init__(
        self,
        buffer: SpanBuffer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: Mapping[str, types.AttributeValue] | None,
        limits: sdk_trace.SpanLimits,
        start_time: int | None,
        record_end_metrics: Callable[[], None] | None,
    ) -> None:
        self._buffer = buffer
        self._name = name
        self._context = context
        self._parent_span_id = parent.span_id if parent is not None else None
        self._limits = limits
        self._lock = threading.Lock()
        self._start_time = start_time if start_time is not None else time_ns()
        self._end_time: int | None = None
        self._status_code = StatusCode.UNSET
        self._record_end_metrics = record_end_metrics
        self._attributes = {}
        if attributes:
            self._put(attributes)

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def _unless_ended(self, method: str) -> bool:
        """True while the span is live; else the SDK's warning for ``method``."""
        if self._end_time is None:
            return True
        log.warning("Tried calling %s on an ended span.", method)
        return False

    def update_name(self, name: str) -> None:
        if self._unless_ended("update_name"):
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if not self._unless_ended("set_status") or self._status_code is StatusCode.OK:
            return
        code = status.status_code if isinstance(status, Status) else status
        if code is not StatusCode.UNSET:  # set to UNSET, or after OK: ignored, as there
            self._status_code = code

    def add_event(
        self,
        name: str,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
    ) -> None:
        self._unless_ended("add_event")  # the buffer files no events

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        self._unless_ended("add_link")  # nor links

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self._unless_ended("add_event")  # an event, which the buffer does not file

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        # As the SDK's span: an exception that leaves the block is an error.
        if exc_val is not None and self.is_recording():
            self.set_status(StatusCode.ERROR)
        self.end()

    def end(self, end_time: int | None = None) -> None:
        with self._lock:
            if self._end_time is not None:
                log.warning("Calling end() on an ended span.")
                return
            self._end_time = end = end_time if end_time is not None else time_ns()
        if self._record_end_metrics:
            self._record_end_metrics()
        context = self._context
        self._buffer.record(
            context.trace_id,
            context.span_id,
            self._parent_span_id,
            self._name,
            self._start_time,
            end,
            status_name(self._status_code),
            self._attributes,
        )


def start_span(
    tracer: Tracer,
    name: str,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, types.AttributeValue] | None = None,
    start_time: int | None = None,
) -> Span:
    """``tracer.start_span(name, context, kind, attributes, start_time=start_time)``, the
    same span: ``BufferedSpan`` when a sampled span's one reader is the tracer's lone
    ``SpanBuffer``, else ``LeanSpan`` when the SDK's tracer would record one."""
    if not isinstance(tracer, sdk_trace.Tracer) or not tracer._is_enabled():
        return tracer.start_span(
            name, context=context, kind=kind, attributes=attributes, start_time=start_time
        )
    parent: SpanContext | None = get_current_span(context).get_span_context()
    if parent is None or not parent.is_valid:
        parent = None
        trace_id = tracer.id_generator.generate_trace_id()
        random_trace_id = tracer.id_generator.is_trace_id_random()
    else:
        trace_id = parent.trace_id
        random_trace_id = parent.trace_flags.random_trace_id
    # The buffer takes the ended span itself (``BufferedSpan``), a trace's first span too.
    buffer = lone_buffer(tracer)
    trace_state: TraceState | None
    if buffer is not None and parent is not None:
        # ParentBasedRatio follows a valid parent, and keeps its trace state.
        sampled = parent.trace_flags.sampled
        decision = Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP
        trace_state = parent.trace_state
        kept = attributes if sampled else None
    else:
        sampling = tracer.sampler.should_sample(context, trace_id, name, kind, attributes)
        decision, trace_state, kept = sampling.decision, sampling.trace_state, sampling.attributes
    sampled = decision is Decision.RECORD_AND_SAMPLE
    span_context = new_span_context(tracer, trace_id, sampled, random_trace_id, trace_state)
    record_end_metrics = tracer._tracer_metrics.start_span(parent, decision)
    if decision is Decision.DROP:
        return NonRecordingSpan(span_context)
    if buffer is not None and sampled:
        # The buffer is the span's one reader (its ``on_start`` does nothing).
        return BufferedSpan(
            buffer,
            name,
            span_context,
            parent,
            kept,
            tracer._span_limits,
            start_time,
            record_end_metrics,
        )
    span = LeanSpan(tracer, name, span_context, parent, kept, kind)
    span._record_end_metrics = record_end_metrics
    span.start(start_time=start_time, parent_context=context)
    return span
