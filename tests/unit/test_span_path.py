"""tokenbus.span_path: spans that tile a request's path, hops stamped through headers."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, Tracer, set_span_in_context

from tokenbus.span_path import (
    MAX_HOP_NS,
    MAX_REQUEST_START_AGE_NS,
    PATH_HEADER,
    SpanPath,
    hop_span,
    path_header,
    path_ns,
    request_start_ns,
)
from tokenbus.tracing import inject, with_path

NOW = 1_767_000_000_123_456_789  # ns since the epoch


def recorder() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


class Ticks:
    def __init__(self, *readings: int) -> None:
        self._readings = iter(readings)

    def __call__(self) -> int:
        return next(self._readings)


def edges(spans: tuple[ReadableSpan, ...]) -> list[tuple[str, int | None, int | None]]:
    return [(s.name, s.start_time, s.end_time) for s in spans]


def test_a_paths_spans_start_where_the_one_before_ended() -> None:
    tracer, exporter = recorder()
    path = SpanPath(tracer, 100, clock=Ticks(130, 170))
    path.add("arrival", 110)
    with path.step("auth"):
        pass
    waiting = path.begin("wait")
    assert path.end(waiting) == 170 == path.at
    assert edges(exporter.get_finished_spans()) == [
        ("arrival", 100, 110),
        ("auth", 110, 130),
        ("wait", 130, 170),
    ]


def test_a_path_never_goes_back() -> None:
    tracer, exporter = recorder()
    path = SpanPath(tracer, 100, clock=Ticks(90))
    path.end(path.begin("stepped back"))  # the wall clock stepped back
    path.add("early", 50)
    assert edges(exporter.get_finished_spans()) == [("stepped back", 100, 100), ("early", 100, 100)]


def test_a_step_that_raises_is_an_error_and_the_path_goes_on() -> None:
    tracer, exporter = recorder()
    path = SpanPath(tracer, 100, clock=Ticks(120, 150))
    with pytest.raises(ValueError), path.step("hygiene"):
        raise ValueError("bad body")
    with path.step("next"):
        pass
    failed, after = exporter.get_finished_spans()
    assert failed.status.status_code is StatusCode.ERROR
    assert (failed.end_time, after.start_time, after.end_time) == (120, 120, 150)


def test_a_hop_spans_the_senders_stamp_to_the_receivers_take() -> None:
    tracer, exporter = recorder()
    with tracer.start_as_current_span("sender") as sender:
        pass
    context = set_span_in_context(sender)
    hop_span(tracer, "bus.request", 100, 140, {"tokenbus.tenant": "t"}, context=context)
    hop_span(tracer, "bus.skewed", 150, 140, context=context)
    hop_span(tracer, "bus.unstamped", None, 140, context=context)
    hop_span(tracer, "bus.ancient", 140 - MAX_HOP_NS - 1, 140, context=context)
    _, hop, skewed = exporter.get_finished_spans()
    assert (hop.name, hop.start_time, hop.end_time) == ("bus.request", 100, 140)
    assert hop.parent is not None and hop.parent.span_id == sender.get_span_context().span_id
    assert hop.attributes == {"tokenbus.tenant": "t"}
    # A receiver's clock behind the sender's: a hop of no length, flagged.
    assert (skewed.start_time, skewed.end_time) == (140, 140)
    assert skewed.attributes == {"tokenbus.clock_skew_ns": 10}


def test_the_path_travels_in_the_headers_beside_the_trace() -> None:
    tracer, _ = recorder()
    headers: list[tuple[str, bytes]] = [(PATH_HEADER, b"1")]
    with tracer.start_as_current_span("admission_wait") as span:
        inject(headers, with_path(NOW, set_span_in_context(span)))
    assert [k for k, _ in headers] == ["traceparent", PATH_HEADER]
    assert path_ns(headers) == NOW
    bare: list[tuple[str, bytes]] = []
    inject(bare, with_path(NOW))  # no span: no trace, so no path either
    assert bare == []


@pytest.mark.parametrize("raw", [b"", b"-5", b"12x", b"0", b"9" * 21])
def test_a_malformed_path_header_is_none(raw: bytes) -> None:
    assert path_ns([(PATH_HEADER, raw)]) is None
    assert path_ns(None) is None
    assert path_ns([path_header(NOW)]) == NOW


@pytest.mark.parametrize(
    "value",
    [
        f"t={NOW // 10**6 / 1000:.3f}",  # nginx: seconds, ms fraction
        f"t={NOW // 10**6}",  # ms
        f"{NOW // 10**3}",  # µs (New Relic's)
        f"t={NOW}",  # ns
    ],
)
def test_x_request_start_is_read_in_any_unit(value: str) -> None:
    got = request_start_ns(value, NOW + 2_000_000)
    assert got is not None and abs(got - NOW) < 10**6


@pytest.mark.parametrize("value", [None, "", "t=", "t=abc", "t=-1", "t=inf", "t=nan"])
def test_x_request_start_that_is_no_time_is_ignored(value: str | None) -> None:
    assert request_start_ns(value, NOW) is None


def test_x_request_start_in_the_future_or_too_old_is_ignored() -> None:
    assert request_start_ns(f"t={NOW + 1}", NOW) is None
    assert request_start_ns(f"t={NOW - MAX_REQUEST_START_AGE_NS - 1}", NOW) is None
    assert request_start_ns(f"t={NOW - MAX_REQUEST_START_AGE_NS}", NOW) is not None
