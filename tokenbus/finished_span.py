"""A span already over when it is made, handed to the tracer's span processors at once.

# (name, start, end, attributes, parent context) --> the tracer's sampler and id generator
#   --> the SDK's ``ReadableSpan`` --> the tracer's span processors' ``on_end``

Half of a request's spans are over before they are made: a record's way over the bus
(``span_path.hop_span``), the engine's phases, read from its timings when the request is
done, an insert's span. Through ``Tracer.start_span`` each pays for a live span it never
uses (its locks, its attributes' validation, its events and links, ``on_start``, then a
copy as a ``ReadableSpan`` at ``end``), which was most of tracing's CPU per request.
``end_span`` makes the same span the SDK would have ended: the tracer's sampler decides on
it, its id generator names it, its resource and scope are the tracer's, and its
processors (``SpanBuffer``, or the OTLP exporter's batch processor) receive it, as they
would at ``end``. A span that starts a trace, an attribute that is not a plain scalar, or
a tracer other than the SDK's goes the SDK's own way, through ``start_span``. When the
tracer's sampler is ``ParentBasedRatio`` (which follows a valid parent) and its one
processor the ``SpanBuffer``, nothing but that buffer would read the span: its fields go
to ``SpanBuffer.record`` directly, with no span context or readable span made for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import (
    SpanContext,
    SpanKind,
    TraceFlags,
    Tracer,
    TraceState,
    get_current_span,
)
from opentelemetry.util.types import AttributeValue

from tokenbus.sampling import ParentBasedRatio
from tokenbus.span_buffer import STATUS_UNSET, SpanBuffer

_SCALARS = frozenset({str, bool, int, float})


def new_span_context(
    tracer: sdk_trace.Tracer,
    trace_id: int,
    sampled: bool,
    random_trace_id: bool,
    trace_state: TraceState | None,
) -> SpanContext:
    """A new local span's context, with a span id from the tracer's generator and the
    sampler's trace state, as ``Tracer.start_span`` makes it: its W3C flags say whether it
    was sampled, and keep the random-trace-id bit of its trace (a child, its parent's)."""
    flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
    if random_trace_id:
        flags |= TraceFlags.RANDOM_TRACE_ID
    return SpanContext(
        trace_id,
        tracer.id_generator.generate_span_id(),
        is_remote=False,
        trace_flags=TraceFlags(flags),
        trace_state=trace_state,
    )


def end_span(
    tracer: Tracer,
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> None:
    """A span from ``start_ns`` to ``end_ns`` under ``context``'s span (or the current
    one), recorded as over."""
    parent = get_current_span(context).get_span_context()
    if (
        not isinstance(tracer, sdk_trace.Tracer)
        or not parent.is_valid
        or (attributes and not all(type(v) in _SCALARS for v in attributes.values()))
    ):
        span = tracer.start_span(
            name, context=context, kind=kind, attributes=attributes, start_time=start_ns
        )
        span.end(end_time=end_ns)
        return
    trace_id = parent.trace_id
    buffer = lone_buffer(tracer)
    if buffer is not None:
        # ParentBasedRatio's decision for a valid parent: the parent's.
        if parent.trace_flags.sampled:
            span_id = tracer.id_generator.generate_span_id()
            buffer.record(
                trace_id, span_id, parent.span_id, name, start_ns, end_ns, STATUS_UNSET, attributes
            )
        return
    sampling = tracer.sampler.should_sample(context, trace_id, name, kind, attributes)
    if sampling.decision is Decision.DROP:
        return
    sampled = sampling.decision is Decision.RECORD_AND_SAMPLE
    span_context = new_span_context(
        tracer, trace_id, sampled, parent.trace_flags.random_trace_id, sampling.trace_state
    )
    tracer.span_processor.on_end(
        sdk_trace.ReadableSpan(
            name,
            context=span_context,
            parent=parent,
            resource=tracer.resource,
            attributes=dict(sampling.attributes),
            kind=kind,
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_info=tracer.instrumentation_info,
            instrumentation_scope=tracer._instrumentation_scope,
        )
    )


def lone_buffer(tracer: sdk_trace.Tracer) -> SpanBuffer | None:
    """The tracer's ``SpanBuffer`` if it is its only processor and its sampler is
    ``ParentBasedRatio``; else None."""
    if type(tracer.sampler) is not ParentBasedRatio:
        return None
    processors: Sequence[object] = getattr(tracer.span_processor, "_span_processors", ())
    if len(processors) == 1 and type(buffer := processors[0]) is SpanBuffer:
        return buffer
    return None
