"""A live span of the SDK's own class, made without the SDK's per-span bookkeeping.

# (name, start, attributes, parent context) --> the tracer's sampler and id generator
#   --> LeanSpan (the SDK's ``Span``, attributes a plain dict while they are scalars)
#   --> at ``end``: the tracer's span processors' ``on_end``, as the SDK's ``ReadableSpan``

A request's live spans (the bridge's request and path steps, the job's admission and
queue, the worker's request) set a few scalar attributes and end. Through
``Tracer.start_span`` each one's attributes go through the SDK's validating, locked
mapping (``BoundedAttributes``, an ABC ``isinstance`` chain per value), twice: at start
and again for each ``set_attribute``; that was a fifth of tracing's work per request.
``start_span`` decides and names the span as ``Tracer.start_span`` does (the tracer's
sampler, its id generator, the parent's random-trace-id flag, its resource, scope and
span limits, the SDK's own span metrics when they are on) and returns the SDK's
``Span``, whose status, events, exceptions and context manager are the SDK's own; only
its attributes are kept as a plain dict while every key is a non-empty ``str``, every
value a ``str``, ``bool``, ``int`` or ``float``, and the span's limits leave them as
they are, and its event and link lists are made at the first. The first attribute that
is not goes into the SDK's ``BoundedAttributes`` with all the others, so what it keeps
and drops is the SDK's decision. A tracer other than the SDK's, or one its configurator
disabled, goes through its own ``start_span``. When the tracer's sampler is
``ParentBasedRatio`` and its one processor the ``SpanBuffer`` (``finished_span``), a span
under a valid parent takes the parent's decision and trace state without a sampling
result, and at ``end`` the buffer reads any sampled span itself (a trace's first span
too, as the job's admission of a record without a ``traceparent``) rather than a
readable copy."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from time import time_ns

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


class LeanSpan(sdk_trace.Span):
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
        self._buffer: SpanBuffer | None = None
        """The tracer's one processor, when it is the ``SpanBuffer``: handed this span."""
        self._attributes: dict[str, types.AttributeValue] | BoundedAttributes = {}
        if attributes:
            self._put(attributes)

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
        if self._buffer is not None:
            # The buffer takes the span's fields at once: no readable copy for it.
            context, parent = self.get_span_context(), self._parent
            self._buffer.record(
                context.trace_id,
                context.span_id,
                parent.span_id if parent is not None else None,
                self._name,
                self._start_time or 0,
                self._end_time,
                status_name(self._status.status_code),
                self._attributes,
            )
            return
        self._span_processor._on_ending(self)
        self._span_processor.on_end(self._readable_span())


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
    same span (``LeanSpan`` when the SDK's tracer would record one)."""
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
    # The buffer takes the ended span itself (``LeanSpan.end``), a trace's first span too.
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
    span = LeanSpan(tracer, name, span_context, parent, kept, kind)
    span._record_end_metrics = record_end_metrics
    span._buffer = buffer if sampled else None  # the SDK's on_end skips the unsampled
    span.start(start_time=start_time, parent_context=context)
    return span
