"""W3C trace context as the SDK's ``TraceContextTextMapPropagator`` reads and writes it,
without its carrier getters and setters.

# a span context --> format_traceparent() / its trace state's header --> the headers
# the headers' ``traceparent``/``tracestate`` values --> parse_traceparent() --> a remote
#   span context, or None where the propagator would leave the context empty

``tokenbus.tracing`` writes a record's headers once per hop and reads them once per
take; through the propagator each went through a generic getter (a list of every value
decoded, per header name), a setter that rebuilt the header list, and the ``re`` module's
cache. The checks are the propagator's, in its order (``tests/unit/test_traceparent.py``
holds the two side by side over valid and malformed headers).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from opentelemetry.trace import INVALID_SPAN_CONTEXT, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.span import _TRACECONTEXT_MAXIMUM_TRACESTATE_LENGTH

MAX_TRACESTATE_LENGTH = _TRACECONTEXT_MAXIMUM_TRACESTATE_LENGTH
"""The longest ``tracestate`` (its values joined) that ``parse_traceparent`` keeps."""

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_MAXIMUM_LENGTH = 512
_FORMAT = re.compile(
    "^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
_NO_TRACE_ID = "0" * 32
_NO_SPAN_ID = "0" * 16


def format_traceparent(context: SpanContext) -> str | None:
    """The ``traceparent`` value of ``context``; None for the invalid span context (the
    propagator writes nothing for it)."""
    if context == INVALID_SPAN_CONTEXT:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def parse_traceparent(
    traceparents: Sequence[str] | None, tracestates: Sequence[str] | None
) -> SpanContext | None:
    """The remote span context the first ``traceparent`` value names, with the
    ``tracestate`` values' state; None when the propagator would refuse it."""
    if not traceparents:
        return None
    header = traceparents[0]
    if len(header) > _MAXIMUM_LENGTH:
        log.warning(
            "traceparent header exceeded the maximum length of %d characters", _MAXIMUM_LENGTH
        )
        return None
    match = _FORMAT.search(header)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if trace_id == _NO_TRACE_ID or span_id == _NO_SPAN_ID:
        return None
    if (version == "00" and rest) or version == "ff":
        return None
    state: TraceState | None = None
    if tracestates is not None:
        # Several header fields are one, joined with "," (RFC 9110, section 5.3).
        length = sum(len(value) for value in tracestates) + len(tracestates) - 1
        if length > _TRACECONTEXT_MAXIMUM_TRACESTATE_LENGTH:
            log.warning(
                "tracestate header exceeded the maximum length of %d characters",
                _TRACECONTEXT_MAXIMUM_TRACESTATE_LENGTH,
            )
        else:
            state = TraceState.from_header(list(tracestates))
    return SpanContext(
        int(trace_id, 16),
        int(span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(flags, 16)),
        trace_state=state,
    )
