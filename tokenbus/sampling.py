"""Which traces are kept: the parent's decision, else a ratio of new traces.

# a span's parent context --> parent sampled? keep : drop
# no valid parent --> TraceIdRatioBased(ratio): the trace id's low 64 bits decide

``ParentBasedRatio`` decides exactly as the SDK's ``ParentBased(TraceIdRatioBased(r))``
with its default delegates (a sampled parent, remote or local, is followed; an
unsampled one is too), in one call instead of three: every span of every request asks
it, and the SDK's chain read the parent out of the context twice more and built a
result per delegate. The ratio is ``Settings.trace_sample_ratio``.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, TraceFlags, TraceState, get_current_span
from opentelemetry.util.types import Attributes


class ParentBasedRatio(ParentBased):
    """``ParentBased(TraceIdRatioBased(ratio))``, decided in one step."""

    def __init__(self, ratio: float) -> None:
        self._ratio = TraceIdRatioBased(ratio)
        super().__init__(self._ratio)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        parent = get_current_span(parent_context).get_span_context()
        if not parent.is_valid:
            return self._ratio.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )
        if parent.trace_flags & TraceFlags.SAMPLED:
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, parent.trace_state)
        return SamplingResult(Decision.DROP, None, parent.trace_state)
