"""tokenbus.finished_span: a span already over is the span the SDK would have ended."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    NoOpTracer,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    Tracer,
    set_span_in_context,
)
from opentelemetry.util.types import AttributeValue

from tokenbus.config import Settings
from tokenbus.finished_span import end_span, lone_buffer
from tokenbus.sampling import ParentBasedRatio
from tokenbus.tracing import Tracing


def recorder(ratio: float = 1.0) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBasedRatio(ratio))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("tokenbus"), exporter


def remote_parent(*, sampled: bool, random: bool = False) -> SpanContext:
    flags = (TraceFlags.SAMPLED if sampled else 0) | (TraceFlags.RANDOM_TRACE_ID if random else 0)
    return SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(flags))


def fields(span: ReadableSpan) -> tuple[object, ...]:
    context = span.context
    assert context is not None
    return (
        span.name,
        span.kind,
        span.parent,
        context.trace_id,
        context.trace_flags,
        context.is_remote,
        dict(span.attributes or {}),
        span.start_time,
        span.end_time,
        span.status.status_code,
        span.resource,
        span.instrumentation_scope,
    )


def test_it_is_the_span_start_span_and_end_make() -> None:
    tracer, exporter = recorder()
    for parent in (remote_parent(sampled=True), remote_parent(sampled=True, random=True)):
        context = set_span_in_context(NonRecordingSpan(parent))
        attributes: dict[str, AttributeValue] = {
            "tokenbus.tenant": "t",
            "tokenbus.attempt": 2,
            "ok": True,
            "x": 0.5,
        }
        end_span(
            tracer, "bus.dispatch", 10, 20, attributes, context=context, kind=SpanKind.CONSUMER
        )
        span = tracer.start_span(
            "bus.dispatch", context, SpanKind.CONSUMER, attributes=attributes, start_time=10
        )
        span.end(end_time=20)
        ours, sdks = exporter.get_finished_spans()
        assert fields(ours) == fields(sdks)
        assert ours.parent == parent and ours.status.status_code is StatusCode.UNSET
        assert ours.context is not None and sdks.context is not None
        assert ours.context.span_id not in (0, sdks.context.span_id)
        exporter.clear()


def test_under_the_current_span_when_no_context_is_given() -> None:
    tracer, exporter = recorder()
    with tracer.start_as_current_span("worker.request") as request:
        end_span(tracer, "worker.prefill", 1, 2, {"tokenbus.tenant": "t"})
    prefill, _ = exporter.get_finished_spans()
    assert prefill.parent is not None
    assert prefill.parent.span_id == request.get_span_context().span_id


def test_an_unsampled_parent_makes_nothing() -> None:
    tracer, exporter = recorder()
    context = set_span_in_context(NonRecordingSpan(remote_parent(sampled=False)))
    end_span(tracer, "bus.request", 1, 2, context=context)
    assert exporter.get_finished_spans() == ()


def test_without_a_parent_it_starts_a_trace_as_the_sdk_does() -> None:
    tracer, exporter = recorder()
    end_span(tracer, "billing.insert", 1, 2, {"tokenbus.tenant": "t"})
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and (span.start_time, span.end_time) == (1, 2)
    end_span(recorder(0.0)[0], "billing.insert", 1, 2)  # the ratio decides: nothing


def test_an_attribute_that_is_no_scalar_is_cleaned_by_the_sdk() -> None:
    tracer, exporter = recorder()
    context = set_span_in_context(NonRecordingSpan(remote_parent(sampled=True)))
    end_span(tracer, "x", 1, 2, {"list": [1, 2]}, context=context)
    (span,) = exporter.get_finished_spans()
    assert span.attributes == {"list": (1, 2)}


def test_a_tracer_other_than_the_sdks_is_used_as_it_is() -> None:
    end_span(NoOpTracer(), "x", 1, 2, {"tokenbus.tenant": "t"})


def test_the_span_buffer_files_it_under_its_tenant() -> None:
    tracing = Tracing(Settings(), "worker")
    context = set_span_in_context(NonRecordingSpan(remote_parent(sampled=True)))
    end_span(tracing.tracer, "bus.dispatch", 5, 9, {"tokenbus.tenant": "acme"}, context=context)
    ((tenant, (record,)),) = tracing.buffer.take().items()  # type: ignore[union-attr]
    assert tenant == "acme"
    assert record["trace_id"] == f"{0xABC:032x}"
    assert record["parent_span_id"] == f"{0xDEF:016x}"
    assert (record["name"], record["service"]) == ("bus.dispatch", "tokenbus-worker")
    assert (record["start_ns"], record["end_ns"], record["status"]) == (5, 9, "unset")


def test_to_a_lone_span_buffer_it_files_what_the_sdks_span_files() -> None:
    tracing = Tracing(Settings(), "worker")
    tracer = tracing.tracer
    assert lone_buffer(tracer) is tracing.buffer  # type: ignore[arg-type]
    context = set_span_in_context(NonRecordingSpan(remote_parent(sampled=True, random=True)))
    attributes: dict[str, AttributeValue] = {
        "tokenbus.tenant": "acme",
        "tokenbus.attempt": 1,
        "ok": True,
        "x": 0.5,
    }
    end_span(tracer, "worker.prefill", 5, 9, attributes, context=context, kind=SpanKind.CONSUMER)
    span = tracer.start_span("worker.prefill", context, SpanKind.CONSUMER, attributes, start_time=5)
    span.end(end_time=9)
    assert tracing.buffer is not None
    ((tenant, (ours, sdks)),) = tracing.buffer.take().items()
    assert tenant == "acme"
    assert ours["span_id"] != sdks["span_id"]
    assert {**ours, "span_id": None} == {**sdks, "span_id": None}
    unsampled = set_span_in_context(NonRecordingSpan(remote_parent(sampled=False)))
    end_span(tracer, "worker.prefill", 5, 9, attributes, context=unsampled)
    assert tracing.buffer.take() == {}


def test_beside_another_processor_it_goes_the_sdks_way() -> None:
    tracing = Tracing(Settings(), "worker")
    exporter = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    context = set_span_in_context(NonRecordingSpan(remote_parent(sampled=True)))
    end_span(tracing.tracer, "bus.dispatch", 5, 9, {"tokenbus.tenant": "acme"}, context=context)
    (exported,) = exporter.get_finished_spans()
    assert tracing.buffer is not None
    ((_, (record,)),) = tracing.buffer.take().items()
    assert exported.context is not None
    assert record["span_id"] == f"{exported.context.span_id:016x}"
