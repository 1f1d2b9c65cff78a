"""tokenbus.lean_span: a live span is the span the SDK's ``Tracer.start_span`` makes."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    NoOpTracer,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TraceState,
    set_span_in_context,
    use_span,
)
from opentelemetry.util.types import AttributeValue

from tokenbus.config import Settings
from tokenbus.lean_span import BufferedSpan, LeanSpan, start_span
from tokenbus.sampling import ParentBasedRatio
from tokenbus.span_buffer import SpanBuffer
from tokenbus.tracing import Tracing

Start = Callable[..., Span]


def recorder(
    ratio: float = 1.0, limits: SpanLimits | None = None
) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBasedRatio(ratio), span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("tokenbus"), exporter


def under(*, sampled: bool, random: bool = False) -> Context:
    flags = (TraceFlags.SAMPLED if sampled else 0) | (TraceFlags.RANDOM_TRACE_ID if random else 0)
    parent = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(flags))
    return set_span_in_context(NonRecordingSpan(parent))


def ours(tracer: Tracer) -> Start:
    return lambda name, **kw: start_span(tracer, name, **kw)


def sdks(tracer: Tracer) -> Start:
    return lambda name, **kw: tracer.start_span(name, **kw)


def fields(span: ReadableSpan) -> tuple[object, ...]:
    context = span.context
    assert context is not None
    return (
        span.name,
        span.kind,
        span.parent,
        context.trace_id if span.parent else None,
        context.trace_flags,
        context.trace_state,
        context.is_remote,
        list((span.attributes or {}).items()),
        span.dropped_attributes,
        span.start_time,
        span.end_time,
        span.status.status_code,
        span.status.description,
        [(e.name, dict(e.attributes or {})) for e in span.events],
        span.resource,
        span.instrumentation_scope,
    )


def both(tracer: Tracer, exporter: InMemorySpanExporter, run: Callable[[Start], None]) -> None:
    """``run`` with our ``start_span`` and with the SDK's: the same spans come out."""
    run(ours(tracer))
    mine = exporter.get_finished_spans()
    exporter.clear()
    run(sdks(tracer))
    theirs = exporter.get_finished_spans()
    exporter.clear()
    assert len(mine) == len(theirs) > 0
    assert [fields(s) for s in mine] == [fields(s) for s in theirs]


@pytest.mark.parametrize(
    "context",
    [under(sampled=True), under(sampled=True, random=True), None],
    ids=["sampled", "random-id", "parentless"],
)
def test_it_is_the_span_start_span_set_attributes_and_end_make(context: object) -> None:
    tracer, exporter = recorder()

    def run(start: Start) -> None:
        span = start(
            "job.admit",
            context=context,
            kind=SpanKind.CONSUMER,
            attributes={"tokenbus.tenant": "t", "tokenbus.attempt": 2},
            start_time=10,
        )
        span.set_attributes({"ok": True, "x": 0.5, "tokenbus.tenant": "u"})
        span.set_attribute("tokenbus.attempt", 3)
        span.set_attribute("tokenbus.outcome", "admitted")
        assert span.is_recording()
        span.end(end_time=20)
        assert not span.is_recording()

    both(tracer, exporter, run)
    run(ours(tracer))
    assert type(exporter.get_finished_spans()[0]) is ReadableSpan


def test_a_started_span_is_the_sdks_lean_one() -> None:
    tracer, _ = recorder()
    span = start_span(tracer, "x", context=under(sampled=True))
    assert isinstance(span, LeanSpan)
    context = span.get_span_context()
    assert context.trace_id == 0xABC and context.span_id not in (0, 0xDEF)


def test_an_unsampled_parent_gives_the_sdks_non_recording_span() -> None:
    tracer, exporter = recorder()
    for parent in (under(sampled=False), under(sampled=False, random=True)):
        mine = start_span(tracer, "job.queue", context=parent)
        theirs = tracer.start_span("job.queue", context=parent)
        assert type(mine) is type(theirs) is NonRecordingSpan
        a, b = mine.get_span_context(), theirs.get_span_context()
        assert (a.trace_id, a.trace_flags, a.is_remote) == (b.trace_id, b.trace_flags, False)
        mine.end()
    assert exporter.get_finished_spans() == ()


def test_the_ratio_decides_for_a_parentless_span() -> None:
    tracer, exporter = recorder(0.0)
    span = start_span(tracer, "bridge.request")
    assert not span.is_recording() and not span.get_span_context().trace_flags.sampled
    span.end()
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize(
    "attributes",
    [
        {"list": [1, 2], "s": "x"},
        {"": "empty key", "s": "x"},
        {"none": None, "s": "x"},
        {"bytes": b"ab", "n": 1},
    ],
    ids=["sequence", "empty-key", "none", "bytes"],
)
def test_an_attribute_that_is_no_plain_scalar_is_the_sdks_to_clean(
    attributes: Mapping[str, AttributeValue],
) -> None:
    tracer, exporter = recorder()

    def run(start: Start) -> None:
        span = start("x", context=under(sampled=True), attributes={"a": 1}, start_time=1)
        span.set_attributes(attributes)
        span.set_attribute("later", "y")
        for key, value in attributes.items():
            span.set_attribute(key, value)
        span.end(end_time=5)

    both(tracer, exporter, run)


def test_the_span_limits_are_the_sdks() -> None:
    limits = SpanLimits(max_span_attributes=3, max_span_attribute_length=4)
    tracer, exporter = recorder(limits=limits)

    def run(start: Start) -> None:
        span = start(
            "x", context=under(sampled=True), attributes={"a": "long value", "b": 1}, start_time=1
        )
        span.set_attributes({"c": 2, "d": "abcdefgh"})
        span.set_attribute("a", "again")
        span.end(end_time=2)

    both(tracer, exporter, run)
    tracer, exporter = recorder(limits=SpanLimits(max_span_attributes=2))

    def over_count(start: Start) -> None:
        span = start("x", context=under(sampled=True), attributes={"a": 1, "b": 2}, start_time=1)
        span.set_attribute("b", 3)  # the same key again: nothing dropped
        span.set_attributes({"c": 4})  # one past the limit: the oldest goes
        span.end(end_time=2)

    both(tracer, exporter, over_count)
    over_count(ours(tracer))
    (span,) = exporter.get_finished_spans()
    assert list((span.attributes or {}).items()) == [("b", 3), ("c", 4)]
    assert span.dropped_attributes == 1


def test_an_exception_under_use_span_is_recorded_as_the_sdk_does() -> None:
    tracer, exporter = recorder()

    def run(start: Start) -> None:
        with (
            pytest.raises(ValueError),
            use_span(start("worker.request", context=under(sampled=True)), end_on_exit=True),
        ):
            raise ValueError("boom")

    run(ours(tracer))
    run(sdks(tracer))
    mine, theirs = exporter.get_finished_spans()
    assert mine.status.status_code is theirs.status.status_code is StatusCode.ERROR
    assert mine.status.description == theirs.status.description == "ValueError: boom"
    assert [e.name for e in mine.events] == [e.name for e in theirs.events] == ["exception"]
    (event,) = mine.events
    assert event.attributes is not None and event.attributes["exception.type"] == "ValueError"


def test_events_links_and_status_are_the_sdks() -> None:
    tracer, exporter = recorder()
    other = SpanContext(0x123, 0x456, is_remote=True, trace_flags=TraceFlags(1))

    def run(start: Start) -> None:
        span = start("bridge.request", context=under(sampled=True), start_time=1)
        span.add_event("first", {"n": 1}, timestamp=2)
        span.add_link(other, {"why": "retry"})
        span.set_status(StatusCode.OK)
        span.set_status(StatusCode.ERROR, "ignored after ok")
        span.update_name("bridge.request2")
        span.end(end_time=3)
        span.set_attribute("late", 1)  # ended: ignored
        span.add_event("late")
        span.end(end_time=4)  # ended: ignored

    both(tracer, exporter, run)
    run(ours(tracer))
    (span,) = exporter.get_finished_spans()
    assert [link.context for link in span.links] == [other]
    assert span.status.status_code is StatusCode.OK and span.end_time == 3


def test_a_tracer_other_than_the_sdks_is_used_as_it_is() -> None:
    span = start_span(NoOpTracer(), "x", attributes={"tokenbus.tenant": "t"})
    assert not span.is_recording()


def test_the_span_buffer_files_it_under_its_tenant() -> None:
    tracing = Tracing(Settings(), "job")
    span = start_span(tracing.tracer, "job.admit", context=under(sampled=True), start_time=5)
    span.set_attribute("tokenbus.tenant", "acme")
    span.end(end_time=9)
    ((tenant, (record,)),) = tracing.buffer.take().items()  # type: ignore[union-attr]
    assert tenant == "acme"
    assert record["parent_span_id"] == f"{0xDEF:016x}"
    assert record["attributes"] == {"tokenbus.tenant": "acme"}
    assert (record["name"], record["start_ns"], record["end_ns"]) == ("job.admit", 5, 9)


@pytest.mark.parametrize("buffered", [False, True], ids=["exported", "lone-buffer"])
def test_the_sdks_own_span_metrics_count_it_as_the_sdk_does(
    buffered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")

    def counts(start: Callable[[Tracer], Start]) -> dict[str, object]:
        reader = InMemoryMetricReader()
        provider = TracerProvider(
            sampler=ParentBasedRatio(1.0), meter_provider=MeterProvider([reader])
        )
        if buffered:  # the buffer alone reads the spans: ours are BufferedSpans
            provider.add_span_processor(SpanBuffer("job"))
        tracer = provider.get_tracer("tokenbus")
        start(tracer)("a", context=under(sampled=True)).end()
        start(tracer)("b", context=under(sampled=False)).end()
        start(tracer)("c", context=under(sampled=True))  # still live
        data = reader.get_metrics_data()
        assert data is not None
        return {
            metric.name: sorted(
                (sorted((point.attributes or {}).items()), point.value)  # type: ignore[union-attr]
                for point in metric.data.data_points
            )
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }

    mine, theirs = counts(ours), counts(sdks)
    assert mine == theirs and {"otel.sdk.span.started", "otel.sdk.span.live"} <= set(mine)


@pytest.mark.parametrize("random", [False, True], ids=["sampled", "random-id"])
def test_to_a_lone_span_buffer_it_files_what_the_sdks_span_files(random: bool) -> None:
    tracing = Tracing(Settings(), "bridge")
    tracer = tracing.tracer
    state = TraceState([("vendor", "x")])
    flags = TraceFlags(TraceFlags.SAMPLED | (TraceFlags.RANDOM_TRACE_ID if random else 0))
    parent = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=flags, trace_state=state)
    context = set_span_in_context(NonRecordingSpan(parent))
    contexts = []
    for start in (ours(tracer), sdks(tracer)):
        span = start(
            "bridge.auth",
            context=context,
            kind=SpanKind.SERVER,
            attributes={"tokenbus.tenant": "acme", "tokenbus.attempt": 2},
            start_time=10,
        )
        span.set_attributes({"ok": True, "x": 0.5})
        span.set_status(StatusCode.ERROR, "no")
        span.end(end_time=20)
        made = span.get_span_context()
        contexts.append((made.trace_id, made.trace_flags, made.trace_state, made.is_remote))
    assert tracing.buffer is not None
    ((tenant, (mine, theirs)),) = tracing.buffer.take().items()
    assert tenant == "acme"
    assert {**mine, "span_id": None} == {**theirs, "span_id": None}
    assert mine["status"] == "error"
    assert contexts[0] == contexts[1]
    unsampled = set_span_in_context(NonRecordingSpan(SpanContext(1, 2, is_remote=True)))
    assert type(start_span(tracer, "x", context=unsampled)) is NonRecordingSpan
    start_span(tracer, "x", context=unsampled).end()
    assert tracing.buffer.take() == {}


def test_a_traces_first_span_goes_to_a_lone_span_buffer_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parentless span (the job's admission of a record with no ``traceparent``) is
    filed as the SDK's span files it, and without a readable copy made for the buffer."""
    tracing = Tracing(Settings(), "job")
    tracer = tracing.tracer
    for start in (ours(tracer), sdks(tracer)):
        span = start(
            "job.admit",
            kind=SpanKind.CONSUMER,
            attributes={"tokenbus.tenant": "acme"},
            start_time=10,
        )
        span.set_attribute("tokenbus.outcome", "admitted")
        span.end(end_time=20)
    assert tracing.buffer is not None
    ((tenant, (mine, theirs)),) = tracing.buffer.take().items()
    assert tenant == "acme" and mine["parent_span_id"] is None
    assert {**mine, "span_id": None, "trace_id": None} == {
        **theirs,
        "span_id": None,
        "trace_id": None,
    }

    def no_copy(self: LeanSpan) -> ReadableSpan:
        raise AssertionError("a readable copy was made for the lone buffer")

    monkeypatch.setattr(LeanSpan, "_readable_span", no_copy)
    start_span(tracer, "job.admit", attributes={"tokenbus.tenant": "acme"}).end()
    assert len(tracing.buffer.take()["acme"]) == 1


def lone(limits: SpanLimits | None = None) -> tuple[Tracer, SpanBuffer]:
    """A tracer whose one processor is a ``SpanBuffer``, as every service's (``Tracing``)."""
    provider = TracerProvider(sampler=ParentBasedRatio(1.0), span_limits=limits)
    buffer = SpanBuffer("job")
    provider.add_span_processor(buffer)
    return provider.get_tracer("tokenbus"), buffer


def filed_alike(
    tracer: Tracer, buffer: SpanBuffer, run: Callable[[Start], None], *, clocked: bool = False
) -> None:
    """``run`` with our ``start_span`` and with the SDK's: the buffer files the same spans
    (their new span ids aside; a parentless span's trace id too; ``clocked``: their times,
    read from the clock, too)."""

    def taken() -> list[dict[str, object]]:
        spans = [s for tenant in buffer.take().values() for s in tenant]
        for span in spans:
            span["span_id"] = None
            if span["parent_span_id"] is None:
                span["trace_id"] = None
            if clocked:
                span["start_ns"] = span["end_ns"] = None
        return spans

    run(ours(tracer))
    mine = taken()
    run(sdks(tracer))
    theirs = taken()
    assert len(mine) == len(theirs) > 0
    assert mine == theirs


@pytest.mark.parametrize(
    "context",
    [under(sampled=True), under(sampled=True, random=True), None],
    ids=["sampled", "random-id", "parentless"],
)
def test_for_a_lone_span_buffer_it_is_a_buffered_span(context: Context | None) -> None:
    tracer, _ = lone()
    span = start_span(tracer, "x", context=context)
    assert isinstance(span, BufferedSpan) and span.is_recording()
    made = span.get_span_context()
    theirs = tracer.start_span("x", context=context).get_span_context()
    assert (made.trace_flags, made.trace_state, made.is_remote) == (
        theirs.trace_flags,
        theirs.trace_state,
        theirs.is_remote,
    )
    if context is not None:
        assert made.trace_id == theirs.trace_id == 0xABC


def test_a_buffered_span_files_what_the_sdks_span_files() -> None:
    tracer, buffer = lone()

    def run(start: Start) -> None:
        span = start(
            "job.admit",
            context=under(sampled=True),
            kind=SpanKind.CONSUMER,
            attributes={"tokenbus.tenant": "t", "tokenbus.attempt": 2},
            start_time=10,
        )
        span.set_attributes({"ok": True, "x": 0.5, "tokenbus.tenant": "u"})
        span.set_attribute("tokenbus.attempt", 3)
        span.set_attribute("list", [1, 2])  # no plain scalar: the SDK's mapping from here
        span.set_attribute("after", "y")
        span.update_name("job.admit2")
        span.add_event("e", {"n": 1})
        span.end(end_time=20)
        assert not span.is_recording()

    filed_alike(tracer, buffer, run)


def test_a_buffered_spans_status_and_late_calls_are_the_sdks() -> None:
    tracer, buffer = lone()
    other = SpanContext(0x123, 0x456, is_remote=True, trace_flags=TraceFlags(1))

    def ok_first(start: Start) -> None:
        span = start("a", context=under(sampled=True), start_time=1)
        span.set_status(StatusCode.UNSET)  # ignored
        span.set_status(StatusCode.OK)
        span.set_status(StatusCode.ERROR, "ignored after ok")
        span.add_link(other)
        span.end(end_time=3)
        span.set_attribute("late", 1)  # ended: each of these is ignored
        span.set_attributes({"later": 2})
        span.set_status(StatusCode.ERROR)
        span.update_name("late")
        span.add_event("late")
        span.end(end_time=4)

    def error(start: Start) -> None:
        span = start("b", context=under(sampled=True), start_time=1)
        span.set_status(Status(StatusCode.ERROR, "no"))
        span.set_status(StatusCode.UNSET)  # ignored
        span.end(end_time=2)

    for run in (ok_first, error):
        filed_alike(tracer, buffer, run)


def test_a_buffered_span_ends_in_error_when_an_exception_leaves_it() -> None:
    tracer, buffer = lone()

    def under_use_span(start: Start) -> None:
        with (
            pytest.raises(ValueError),
            use_span(start("worker.request", context=under(sampled=True)), end_on_exit=True),
        ):
            raise ValueError("boom")

    def as_its_own_block(start: Start) -> None:
        with pytest.raises(KeyError), start("bridge.request", context=under(sampled=True)):
            raise KeyError("k")

    for run in (under_use_span, as_its_own_block):
        filed_alike(tracer, buffer, run, clocked=True)
    for run in (under_use_span, as_its_own_block):
        run(ours(tracer))
    assert [s["status"] for s in buffer.take()["-"]] == ["error", "error"]


def test_a_buffered_span_keeps_the_sdks_limits() -> None:
    tracer, buffer = lone(SpanLimits(max_span_attributes=2, max_span_attribute_length=4))

    def run(start: Start) -> None:
        span = start(
            "x",
            context=under(sampled=True),
            attributes={"tokenbus.tenant": "acme", "b": "long value"},
            start_time=1,
        )
        span.set_attribute("c", 3)  # one past the limit: the oldest goes
        span.end(end_time=2)

    filed_alike(tracer, buffer, run)
