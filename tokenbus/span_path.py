"""A request's path to its first token as spans that tile it: no gap, no overlap.

# a service's steps --> SpanPath: each span starts where the one before ended
# a record sent on --> ``tokenbus-path-ns`` header: where the sender's path stands
# the receiver --> hop_span() "bus.*": from that instant to its handler taking the record,
#   then its own path spans from the same instant

Every boundary is one integer (wall-clock ns) handed from one span to the next, in a
process through ``SpanPath.at``, between processes through the header, so the spans on
the path add up to its length by construction. A hop span spans the sender's hand-off
(encoding, the producer's queue), the broker, the receiver's fetch queue and its wait
for an event loop: everything between two services. Across machines it is only as right
as their clocks are synchronised (NTP or PTP): one machine's clock serves every service
in development; a receiver whose clock reads earlier than the sender's gets a hop of no
length, flagged ``tokenbus.clock_skew_ns``, rather than a negative one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer, use_span
from opentelemetry.util.types import AttributeValue

from tokenbus.finished_span import end_span
from tokenbus.lean_span import start_span

PATH_HEADER = "tokenbus-path-ns"
"""Record header: the wall-clock ns at which the sender's path to the first token stands
when it hands the record on (decimal ASCII)."""

REQUEST_START_HEADER = "x-request-start"
"""HTTP header a load balancer (or the caller) stamps with the request's arrival, as
nginx, Heroku and the APM agents that read it do: ``t=<epoch>`` in s, ms, µs or ns."""

MAX_REQUEST_START_AGE_NS = 60 * 10**9
"""An ``X-Request-Start`` older than this (or in the future) is not believed."""

MAX_HOP_NS = 3600 * 10**9
"""A record's ``PATH_HEADER`` more than this before its take is not believed: a producer
writes that header, so a request topic's record may carry any number; a stamp an hour
old makes no hop span (the trace shows the record as unstamped) rather than a bar
reaching back to whatever the producer wrote."""

Clock = Callable[[], int]


class SpanPath:
    """Spans of one service that tile an interval: each starts at ``at``, where the
    previous one ended, and moves ``at`` to its own end."""

    def __init__(self, tracer: Tracer, start_ns: int, *, clock: Clock = time.time_ns) -> None:
        self._tracer = tracer
        self._clock = clock
        self.at = start_ns

    def begin(
        self,
        name: str,
        attributes: Mapping[str, AttributeValue] | None = None,
        *,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Span:
        """A span from ``at``; ``end`` it to move the path on."""
        return start_span(
            self._tracer,
            name,
            context=context,
            kind=kind,
            attributes=attributes,
            start_time=self.at,
        )

    def end(self, span: Span, end_ns: int | None = None) -> int:
        """Ends ``span`` now (or at ``end_ns``, never before ``at``); returns its end,
        which is where the path now stands."""
        end = max(self.at, self._clock() if end_ns is None else end_ns)
        span.end(end_time=end)
        self.at = end
        return end

    def add(
        self,
        name: str,
        end_ns: int,
        attributes: Mapping[str, AttributeValue] | None = None,
        *,
        context: Context | None = None,
    ) -> int:
        """A span already over: from ``at`` to ``end_ns`` (never before ``at``)."""
        end = max(self.at, end_ns)
        end_span(self._tracer, name, self.at, end, attributes, context=context)
        self.at = end
        return end

    @contextmanager
    def step(
        self, name: str, attributes: Mapping[str, AttributeValue] | None = None
    ) -> Iterator[Span]:
        """A span from ``at`` around a block, current within it; an exception ends it
        with an error status and goes on."""
        span = self.begin(name, attributes)
        try:
            with use_span(span, end_on_exit=False):
                yield span
        finally:
            self.end(span)


def hop_span(
    tracer: Tracer,
    name: str,
    sent_ns: int | None,
    taken_ns: int,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    context: Context | None = None,
) -> None:
    """A record's way between two services, ``sent_ns`` (its ``PATH_HEADER``) to
    ``taken_ns`` (its handler's start); nothing when the sender stamped no path or a
    stamp more than ``MAX_HOP_NS`` old."""
    if sent_ns is None or taken_ns - sent_ns > MAX_HOP_NS:
        return
    if sent_ns > taken_ns:
        attributes = {**(attributes or {}), "tokenbus.clock_skew_ns": sent_ns - taken_ns}
    start = min(sent_ns, taken_ns)
    end_span(tracer, name, start, taken_ns, attributes, context=context, kind=SpanKind.CONSUMER)


def path_header(ns: int) -> tuple[str, bytes]:
    return (PATH_HEADER, str(ns).encode())


def path_ns(headers: Sequence[tuple[str, bytes | None]] | None) -> int | None:
    """The ``PATH_HEADER`` a record carries; None if absent or not a positive integer."""
    for key, value in headers or ():
        if key == PATH_HEADER and value is not None:
            return _positive_int(value)
    return None


def request_start_ns(value: str | None, received_ns: int) -> int | None:
    """``X-Request-Start``'s instant in ns, if it is one and at most
    ``MAX_REQUEST_START_AGE_NS`` before ``received_ns``: its unit is read from its size
    (seconds with a fraction, as nginx's ``t=${msec}``, or whole ms, µs or ns)."""
    if not value:
        return None
    text = value.strip().removeprefix("t=")
    try:
        number: int | float = int(text) if text.isdigit() else float(text)
    except ValueError:
        return None
    if not 0 < number < float("inf"):
        return None
    # Since the epoch: s until the year 5138, then ms, µs, ns (as New Relic reads it).
    scale = next(s for limit, s in _UNITS if number < limit)
    ns = number * scale if isinstance(number, int) else round(number * scale)
    if not 0 <= received_ns - ns <= MAX_REQUEST_START_AGE_NS:
        return None
    return ns


_UNITS = ((1e11, 10**9), (1e14, 10**6), (1e17, 10**3), (float("inf"), 1))


def _positive_int(raw: bytes) -> int | None:
    if not raw.isdigit() or len(raw) > 20:
        return None
    number = int(raw)
    return number or None
