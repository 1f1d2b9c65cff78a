"""tokenbus.tracing: trace context through Kafka headers, spans to the span topic."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, get_current_span

from schemas import decode
from schemas.spans import SpanBatch
from tests.unit.fakes import work_item
from tokenbus.config import Settings
from tokenbus.tracing import (
    ATTR_TENANT,
    Tracing,
    extract,
    inject,
    span_attributes,
    work_item_attributes,
)


def test_a_span_opened_under_a_records_headers_is_the_senders_child() -> None:
    tracing = Tracing(Settings(), "client")
    headers: list[tuple[str, bytes]] = [("authorization", b"secret")]
    with tracing.tracer.start_as_current_span("client.submit") as sent:
        inject(headers)
    assert [k for k, _ in headers] == ["authorization", "traceparent"]
    job = Tracing(Settings(), "job")
    with job.tracer.start_as_current_span("job.admit", context=extract(headers)) as admit:
        pass
    assert admit.get_span_context().trace_id == sent.get_span_context().trace_id
    assert isinstance(admit, ReadableSpan)  # the SDK's span, which knows its parent
    assert admit.parent is not None and admit.parent.span_id == sent.get_span_context().span_id


def test_inject_replaces_a_traceparent_already_there() -> None:
    tracing = Tracing(Settings(), "job")
    headers = [("traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")]
    with tracing.tracer.start_as_current_span("job.forward") as span:
        inject(headers)
    (value,) = [v for k, v in headers if k == "traceparent"]
    assert value.decode().split("-")[2] == f"{span.get_span_context().span_id:016x}"


def test_a_malformed_or_missing_traceparent_starts_a_trace_of_its_own() -> None:
    tracing = Tracing(Settings(), "job")
    for headers in (None, [], [("traceparent", b"00-zz-yy-01")], [("traceparent", b"\xff")]):
        context = extract(headers)
        assert not get_current_span(context).get_span_context().is_valid
        with tracing.tracer.start_as_current_span("job.admit", context=context) as span:
            assert isinstance(span, ReadableSpan) and span.parent is None
            assert span.get_span_context().is_valid


def test_spans_are_flushed_as_one_batch_per_tenant() -> None:
    tracing = Tracing(Settings(), "worker")
    for tenant, request_id in (("acme", "r1"), ("globex", "r2"), ("acme", "r3")):
        attributes = span_attributes(tenant=tenant, request_id=request_id, attempt=0)
        with tracing.tracer.start_as_current_span("worker.decode", attributes=attributes):
            pass
    with tracing.tracer.start_as_current_span("failed") as span:
        span.set_attribute(ATTR_TENANT, "acme")
        span.set_status(StatusCode.ERROR)
    sent: list[tuple[str, bytes, bytes]] = []

    async def publish(
        topic: str, key: bytes, value: bytes, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> None:
        sent.append((topic, key, value))

    assert asyncio.run(tracing.flush(publish)) == 4
    assert asyncio.run(tracing.flush(publish)) == 0  # nothing twice
    batches = {key: decode(SpanBatch, value) for _, key, value in sent}
    assert {topic for topic, _, _ in sent} == {"tokenbus.spans"}
    assert sorted(batches) == [b"acme", b"globex"]
    acme = batches[b"acme"]
    assert acme.tenant_id == "acme"
    assert [s.attributes.get("tokenbus.request_id") for s in acme.spans] == ["r1", "r3", None]
    assert acme.spans[-1].status == "error"
    assert all(s.service == "tokenbus-worker" and s.end_ns >= s.start_ns for s in acme.spans)


def test_a_refused_batch_is_dropped_and_the_rest_sent() -> None:
    tracing = Tracing(Settings(), "job")
    for tenant in ("acme", "globex"):
        with tracing.tracer.start_as_current_span("x", attributes={ATTR_TENANT: tenant}):
            pass
    sent: list[bytes] = []

    async def publish(
        topic: str, key: bytes, value: bytes, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> None:
        if key == b"acme":
            raise RuntimeError("broker refused")
        sent.append(key)

    assert asyncio.run(tracing.flush(publish)) == 1
    assert sent == [b"globex"]


def test_sampling_at_zero_keeps_nothing_and_a_sampled_parent_wins() -> None:
    tracing = Tracing(Settings(trace_sample_ratio=0.0), "job")
    with tracing.tracer.start_as_current_span("root"):
        pass
    assert tracing.buffer is not None and tracing.buffer.take() == {}
    sampled = Tracing(Settings(), "client")
    headers: list[tuple[str, bytes]] = []
    with sampled.tracer.start_as_current_span("client.submit"):
        inject(headers)
    with tracing.tracer.start_as_current_span("job.admit", context=extract(headers)):
        pass
    assert len(tracing.buffer.take()["-"]) == 1


def test_the_buffer_is_bounded() -> None:
    tracing = Tracing(Settings(), "job")
    assert tracing.buffer is not None
    tracing.buffer.max_spans = 3
    for _ in range(5):
        with tracing.tracer.start_as_current_span("x"):
            pass
    assert len(tracing.buffer.take()["-"]) == 3
    assert tracing.buffer.num_dropped == 2


def test_with_an_exporter_spans_go_there_and_not_to_the_topic() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(Settings(), "bridge", exporter=exporter)
    assert tracing.buffer is None
    with tracing.tracer.start_as_current_span("bridge.request"):
        pass
    tracing.shutdown()  # flushes the batch processor
    (span,) = exporter.get_finished_spans()
    assert span.name == "bridge.request"
    assert span.resource.attributes["service.name"] == "tokenbus-bridge"


def test_a_work_item_s_attributes_name_it_and_its_attempt_only_when_asked() -> None:
    item = work_item(priority=2, batch_id="batch_01")
    assert work_item_attributes(item) == span_attributes(
        tenant="t1", request_id="r1", session_id="s1", priority=2, model="m", batch_id="batch_01"
    )
    assert work_item_attributes(item, attempt=0, worker="w1") == {
        **work_item_attributes(item),
        "tokenbus.attempt": 0,
        "tokenbus.worker": "w1",
    }
