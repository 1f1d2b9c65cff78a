"""tokenbus.span_buffer: ended spans, kept by tenant, one dict per span."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.util.types import AttributeValue

from tokenbus.sampling import ParentBasedRatio
from tokenbus.span_buffer import NO_TENANT, SpanBuffer

PARENT = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def buffered() -> tuple[TracerProvider, SpanBuffer]:
    provider = TracerProvider(sampler=ParentBasedRatio(1.0))
    buffer = SpanBuffer("tokenbus-job")
    provider.add_span_processor(buffer)
    return provider, buffer


def test_record_files_what_on_end_files_for_the_same_span() -> None:
    provider, buffer = buffered()
    tracer = provider.get_tracer("tokenbus")
    attributes: dict[str, AttributeValue] = {
        "tokenbus.tenant": "acme",
        "tokenbus.attempt": 1,
        "ok": True,
        "x": 0.5,
    }
    span = tracer.start_span(
        "job.admit",
        set_span_in_context(NonRecordingSpan(PARENT)),
        SpanKind.CONSUMER,
        attributes=attributes,
        start_time=10,
    )
    span.set_status(StatusCode.ERROR)
    span.end(end_time=20)
    context = span.get_span_context()
    buffer.record(
        context.trace_id, context.span_id, 0xDEF, "job.admit", 10, 20, "error", attributes
    )
    ((tenant, (by_sdk, by_record)),) = buffer.take().items()
    assert tenant == "acme"
    assert by_sdk == by_record
    assert by_record["attributes"] is not attributes  # its own copy: the caller's may change
    assert by_record == {
        "trace_id": f"{0xABC:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{0xDEF:016x}",
        "name": "job.admit",
        "service": "tokenbus-job",
        "start_ns": 10,
        "end_ns": 20,
        "status": "error",
        "attributes": attributes,
    }


def test_a_span_without_tenant_or_parent_and_with_a_sequence() -> None:
    _, buffer = buffered()
    buffer.record(1, 2, None, "n" * 300, 1, 2, "unset", {"list": (1, 2), "k": "v"})
    ((tenant, (record,)),) = buffer.take().items()
    assert tenant == NO_TENANT
    assert record["parent_span_id"] is None and record["name"] == "n" * 256
    assert record["attributes"] == {"k": "v"}


def test_trace_ids_are_formatted_right_past_the_remembered_ones() -> None:
    _, buffer = buffered()
    for trace_id in range(1, 5000):
        buffer.record(trace_id, 1, None, "x", 1, 2, "unset", {})
    buffer.record(4999, 1, None, "x", 1, 2, "unset", {})
    buffer.record(1, 1, None, "x", 1, 2, "unset", {})
    records = buffer.take()[NO_TENANT]
    assert [r["trace_id"] for r in records] == [f"{n:032x}" for n in (*range(1, 5000), 4999, 1)]


def test_past_max_spans_a_record_is_counted_and_left_out() -> None:
    _, buffer = buffered()
    buffer.max_spans = 2
    for _ in range(3):
        buffer.record(1, 2, None, "x", 1, 2, "unset", None)
    assert len(buffer.take()[NO_TENANT]) == 2 and buffer.num_dropped == 1
