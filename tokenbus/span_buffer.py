"""A service's ended spans, kept by tenant until ``Tracing.flush`` sends them.

# the SDK's ``on_end(ReadableSpan)`` --> record() --> one dict per span, by tenant
# ``finished_span.end_span`` --> record(), when this buffer is the tracer's only processor
# ``take()`` --> ``Tracing.flush``: one ``SpanBatch`` per tenant

``record`` is the buffer's one entry: the SDK's ``on_end`` reads a ``ReadableSpan``'s
fields into it, and ``end_span`` hands it the same fields directly when nothing but this
buffer would see the span (no exporter, no other processor), so a span that is already
over is filed without the SDK's span context and readable span made only to be read
back here. Either way the stored dict is the same, field for field.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import StatusCode, TraceFlags

TENANT_ATTRIBUTE = "tokenbus.tenant"
"""The attribute a span is filed under (``tracing.ATTR_TENANT``)."""
NO_TENANT = "-"
"""The key of spans that belong to no tenant (none of tokenbus's spans today)."""

STATUS_UNSET = "unset"
_STATUS = {StatusCode.UNSET: STATUS_UNSET, StatusCode.OK: "ok", StatusCode.ERROR: "error"}
_SCALARS = frozenset({str, bool, int, float})
_TRACE_IDS_KEPT = 4096
"""Hex trace ids remembered: a request's spans share one, so most are formatted once."""


class SpanBuffer(SpanProcessor):
    """Keeps the spans the service ended, by tenant, until ``Tracing.flush`` sends them.
    Bounded: past ``max_spans`` a span is counted in ``num_dropped`` and left out."""

    def __init__(self, service: str, max_spans: int = 100_000) -> None:
        self.service = service
        self.max_spans = max_spans
        self.num_dropped = 0
        self._num_spans = 0
        self._by_tenant: dict[str, list[dict[str, object]]] = defaultdict(list)
        self._trace_hex: dict[int, str] = {}

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None or not context.trace_flags & TraceFlags.SAMPLED:
            return
        parent = span.parent
        self.record(
            context.trace_id,
            context.span_id,
            parent.span_id if parent else None,
            span.name,
            span.start_time or 0,
            span.end_time or 0,
            status_name(span.status.status_code),
            span.attributes,
        )

    def record(
        self,
        trace_id: int,
        span_id: int,
        parent_span_id: int | None,
        name: str,
        start_ns: int,
        end_ns: int,
        status: str,
        attributes: Mapping[str, object] | None,
    ) -> None:
        """One sampled span, ended."""
        if self._num_spans >= self.max_spans:
            self.num_dropped += 1
            return
        scalars = _scalars(attributes)
        tenant = scalars.get(TENANT_ATTRIBUTE, NO_TENANT)
        trace_hex = self._trace_hex.get(trace_id)
        if trace_hex is None:
            if len(self._trace_hex) >= _TRACE_IDS_KEPT:
                self._trace_hex.clear()
            trace_hex = self._trace_hex[trace_id] = f"{trace_id:032x}"
        self._by_tenant[tenant if type(tenant) is str else str(tenant)].append(
            {
                "trace_id": trace_hex,
                "span_id": f"{span_id:016x}",
                "parent_span_id": None if parent_span_id is None else f"{parent_span_id:016x}",
                "name": name[:256],
                "service": self.service,
                "start_ns": start_ns,
                "end_ns": end_ns,
                "status": status,
                "attributes": scalars,
            }
        )
        self._num_spans += 1

    def take(self) -> dict[str, list[dict[str, object]]]:
        """The spans kept so far, by tenant; the buffer starts again empty."""
        taken, self._by_tenant = self._by_tenant, defaultdict(list)
        self._num_spans = 0
        return taken

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def status_name(code: StatusCode) -> str:
    """The stored name of a span's status."""
    return _STATUS[code]


def _scalars(attributes: Mapping[str, object] | None) -> dict[str, object]:
    """The span's scalar attributes (a sequence is left out), as a dict of its own. A
    span's attributes are a locked mapping, slow to walk key by key: its ``copy()`` is a
    plain dict at once."""
    if not attributes:
        return {}
    if type(attributes) is dict:
        copied = attributes.copy()
    else:
        copied = attributes.copy() if hasattr(attributes, "copy") else dict(attributes)
    if _SCALARS.issuperset(map(type, copied.values())):
        return copied  # type: ignore[no-any-return]
    return {k: v for k, v in copied.items() if isinstance(v, str | bool | int | float)}
