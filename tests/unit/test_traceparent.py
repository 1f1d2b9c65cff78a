"""tokenbus.traceparent, and tokenbus.tracing's inject/extract built on it: what the SDK's
TraceContextTextMapPropagator reads and writes, header for header."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    TraceState,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokenbus.traceparent import format_traceparent, parse_traceparent
from tokenbus.tracing import extract, extract_http, inject, with_path

PROPAGATOR = TraceContextTextMapPropagator()
TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"


class ListGetter(Getter[Sequence[tuple[str, bytes]]]):
    """The getter tokenbus.tracing gave the propagator before."""

    def get(self, carrier: Sequence[tuple[str, bytes]], key: str) -> list[str] | None:
        found = [v.decode("latin-1") for k, v in carrier if k == key and v is not None]
        return found or None

    def keys(self, carrier: Sequence[tuple[str, bytes]]) -> list[str]:
        return [k for k, _ in carrier]


class ListSetter(Setter[list[tuple[str, bytes]]]):
    def set(self, carrier: list[tuple[str, bytes]], key: str, value: str) -> None:
        carrier[:] = [(k, v) for k, v in carrier if k != key]
        carrier.append((key, value.encode()))


TRACEPARENTS = [
    f"00-{TRACE}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-00",
    f"00-{TRACE}-{SPAN}-03",
    f" \t00-{TRACE}-{SPAN}-01 \t",
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has no more fields
    f"01-{TRACE}-{SPAN}-01-extra",  # a later version may
    f"01-{TRACE}-{SPAN}-01",
    f"ff-{TRACE}-{SPAN}-01",
    f"00-{TRACE.upper()}-{SPAN}-01",
    f"00-{'0' * 32}-{SPAN}-01",
    f"00-{TRACE}-{'0' * 16}-01",
    f"00-{TRACE[:-1]}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-1",
    f"00_{TRACE}_{SPAN}_01",
    f"01-{TRACE}-{SPAN}-01-" + "x" * 600,  # over 512 characters
    "",
    "garbage",
]
TRACESTATES: list[list[str] | None] = [
    None,
    ["congo=t61rcWkgMzE"],
    ["congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7"],
    ["not a valid state"],
    ["a=" + "b" * 600],  # a value over 256 characters
    [",".join(f"key{i}=value{i:0250d}" for i in range(32))],  # over 8,192 characters in all
    [f"key{i}=value{i:0250d}" for i in range(32)],  # as many header fields
    ["a=1,a=2"],
]


def sdk_extract(headers: list[tuple[str, bytes]]) -> Context:
    return PROPAGATOR.extract(headers, getter=ListGetter())


def span_context_of(context: Context) -> SpanContext:
    return get_current_span(context).get_span_context()


@pytest.mark.parametrize("traceparent", TRACEPARENTS)
@pytest.mark.parametrize("tracestate", TRACESTATES)
def test_extract_reads_what_the_propagator_reads(
    traceparent: str, tracestate: list[str] | None
) -> None:
    headers = [("traceparent", traceparent.encode()), ("other", b"x")]
    headers += [("tracestate", value.encode()) for value in tracestate or ()]
    ours, sdks = extract(headers), sdk_extract(headers)
    assert span_context_of(ours) == span_context_of(sdks)
    assert span_context_of(ours).trace_state == span_context_of(sdks).trace_state
    assert list(ours) == list(sdks)  # nothing else in the context, either way
    parsed = parse_traceparent([traceparent], tracestate)
    assert (parsed or INVALID_SPAN_CONTEXT) == span_context_of(sdks)


def test_the_first_traceparent_counts_and_a_none_value_is_skipped() -> None:
    headers: list[tuple[str, bytes | None]] = [
        ("traceparent", None),
        ("traceparent", f"00-{TRACE}-{SPAN}-01".encode()),
        ("traceparent", f"00-{TRACE}-{'1' * 16}-01".encode()),
    ]
    ours = span_context_of(extract(headers))  # type: ignore[arg-type]
    assert ours == span_context_of(sdk_extract(headers))  # type: ignore[arg-type]
    assert ours.span_id == int(SPAN, 16) and ours.is_remote


@pytest.mark.parametrize("num_fields", [2, 100, 5_000])
def test_a_record_stuffed_with_trace_headers_reads_as_the_propagator_reads_it(
    num_fields: int,
) -> None:
    # A producer may send any number of headers; the job reads them in one pass, and
    # keeps no more of the state than the parser reads.
    headers: list[tuple[str, bytes]] = []
    for i in range(num_fields):
        headers.append(("traceparent", f"00-{TRACE}-{i + 1:016x}-01".encode()))
        headers.append(("tracestate", f"k{i}=v{i}".encode()))
    ours, sdks = span_context_of(extract(headers)), span_context_of(sdk_extract(headers))
    assert ours == sdks and ours.span_id == 1
    assert ours.trace_state == sdks.trace_state
    # Past 32 members (or 512 characters) the state is dropped whole.
    assert len(ours.trace_state or ()) == (num_fields if num_fields <= 32 else 0)


@pytest.mark.parametrize("headers", [None, [], [("tracestate", b"a=1")]])
def test_no_traceparent_is_an_empty_context(headers: list[tuple[str, bytes]] | None) -> None:
    assert list(extract(headers)) == list(sdk_extract(list(headers or ()))) == []


@pytest.mark.parametrize("traceparent", TRACEPARENTS[:8])
def test_extract_http_reads_what_the_propagator_reads(traceparent: str) -> None:
    headers = {"traceparent": traceparent, "tracestate": "congo=t61rcWkgMzE"}
    ours, sdks = extract_http(headers), PROPAGATOR.extract(headers)
    assert span_context_of(ours) == span_context_of(sdks)
    assert span_context_of(ours).trace_state == span_context_of(sdks).trace_state
    assert extract_http({}) == PROPAGATOR.extract({}) == Context()


SPAN_CONTEXTS = [
    SpanContext(int(TRACE, 16), int(SPAN, 16), is_remote=False, trace_flags=TraceFlags(1)),
    SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(0)),
    SpanContext(
        int(TRACE, 16),
        int(SPAN, 16),
        is_remote=False,
        trace_flags=TraceFlags(3),
        trace_state=TraceState([("congo", "t61rcWkgMzE"), ("rojo", "00f067aa0ba902b7")]),
    ),
    INVALID_SPAN_CONTEXT,
]


@pytest.mark.parametrize("span_context", SPAN_CONTEXTS)
@pytest.mark.parametrize("before", [[], [("traceparent", b"old"), ("k", b"v")]])
def test_inject_writes_what_the_propagator_writes(
    span_context: SpanContext, before: list[tuple[str, bytes]]
) -> None:
    context = set_span_in_context(NonRecordingSpan(span_context))
    ours, sdks = list(before), list(before)
    inject(ours, context)
    PROPAGATOR.inject(sdks, context, ListSetter())
    assert [h for h in ours if h[0] != "tokenbus-path-ns"] == sdks
    written = format_traceparent(span_context)
    if span_context == INVALID_SPAN_CONTEXT:
        assert written is None
    else:
        assert written is not None and ("traceparent", written.encode()) in ours


def test_inject_writes_the_path_only_beside_a_traceparent() -> None:
    valid = set_span_in_context(NonRecordingSpan(SPAN_CONTEXTS[0]))
    headers: list[tuple[str, bytes]] = [("tokenbus-path-ns", b"1")]
    inject(headers, with_path(42, valid))
    assert headers[-2:] == [
        ("traceparent", f"00-{TRACE}-{SPAN}-01".encode()),
        ("tokenbus-path-ns", b"42"),
    ]
    assert len(headers) == 2
    nothing: list[tuple[str, bytes]] = []
    inject(nothing, with_path(42, Context()))
    assert nothing == []
    kept = [("traceparent", b"from before")]
    inject(kept, with_path(7, Context()))
    assert kept == [("traceparent", b"from before"), ("tokenbus-path-ns", b"7")]


def test_a_round_trip_keeps_the_span_context() -> None:
    for span_context in SPAN_CONTEXTS[:3]:
        headers: list[tuple[str, bytes]] = []
        inject(headers, set_span_in_context(NonRecordingSpan(span_context)))
        back = span_context_of(extract(headers))
        assert (back.trace_id, back.span_id, back.trace_flags, back.trace_state) == (
            span_context.trace_id,
            span_context.span_id,
            span_context.trace_flags,
            span_context.trace_state,
        )
        assert back.is_remote
