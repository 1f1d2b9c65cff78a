"""Spans as rows and a request's trace as a timeline. Pure.

# SpanBatch (spans topic) --> span_rows() --> ClickHouse ``spans`` (billing.span_sink)
# ``tokenbus trace REQUEST_ID`` --> TRACE_SQL (the tenant's spans of the traces that
#   name the request) --> timeline() --> render()
# the query server's ``GET /trace/REQUEST_ID`` --> TRACE_SQL --> timeline()
#   --> billing.trace_page.render_trace
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from billing.span_codec import SpanBatchRecord
from schemas import REQUEST_ID_PATTERN, TENANT_ID_PATTERN
from schemas.spans import SpanBatch
from tokenbus.tracing import ATTR_ATTEMPT, ATTR_REQUEST

SPAN_COLUMNS = (
    "tenant_id",
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "service",
    "start_time",
    "duration_us",
    "status",
    "request_id",
    "attempt",
    "attributes",
)

TRACE_SQL = """
SELECT trace_id, span_id, parent_span_id, name, service, start_time, duration_us,
       status, request_id, attempt, attributes
FROM spans FINAL
WHERE tenant_id = {tenant:String}
  AND trace_id IN (
      SELECT trace_id FROM spans
      WHERE tenant_id = {tenant:String} AND request_id = {request_id:String}
  )
ORDER BY start_time, span_id
"""
"""Every span of every trace in which ``request_id`` of ``tenant`` appears: a resumed
request's attempts share its trace, a bridge request's trace holds all four services."""


_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
_TENANT_ID = re.compile(TENANT_ID_PATTERN)
_INT32 = range(-(2**31), 2**31)
"""The ``attempt`` column's values: any other attempt is stored as none (-1), since one
out of range would fail the insert of every span gathered with it, again and again."""


def lookup_problem(request_id: str, tenant: str) -> str | None:
    """Why ``(request_id, tenant)`` cannot name a trace, or None: both must have the
    shape the bus admits (``schemas.RequestId``, ``schemas.TenantId``), so an outsider's
    text never reaches a query or a page as an id."""
    if not tenant:
        return "the tenant is required (?tenant=TENANT): a trace is read within its tenant"
    if not _TENANT_ID.fullmatch(tenant):
        return "the tenant must be 1 to 128 letters, digits, '_' or '-'"
    if not _REQUEST_ID.fullmatch(request_id):
        return "the request id must be 1 to 128 letters, digits, '_', '.', ':' or '-'"
    return None


def span_rows(batch: SpanBatch | SpanBatchRecord) -> list[tuple[Any, ...]]:
    """One row per span, in ``SPAN_COLUMNS`` order, under the batch's tenant (the record
    key's, which the sink checked): the start in µs since the epoch (the column's
    ticks), attributes as text."""
    rows = []
    for span in batch.spans:
        attributes = span.attributes
        attempt = attributes.get(ATTR_ATTEMPT, -1)
        rows.append(
            (
                batch.tenant_id,
                span.trace_id,
                span.span_id,
                span.parent_span_id or "",
                span.name,
                span.service,
                span.start_ns // 1000,  # DateTime64(6) ticks: no datetime per span
                max(span.end_ns - span.start_ns, 0) // 1000,
                span.status,
                str(attributes.get(ATTR_REQUEST, "")),
                attempt if isinstance(attempt, int) and attempt in _INT32 else -1,
                {k: str(v) for k, v in attributes.items()},
            )
        )
    return rows


@dataclass(frozen=True)
class Step:
    """One span in a trace's timeline."""

    depth: int
    offset_ms: float
    """Start, from the trace's first span."""
    duration_ms: float
    name: str
    service: str
    status: str
    attempt: int
    trace_id: str
    attributes: tuple[tuple[str, str], ...] = ()
    """The span's attributes, sorted by name."""


def timeline(rows: Iterable[Mapping[str, Any]]) -> list[Step]:
    """``TRACE_SQL``'s rows as trees, parents before children and siblings by start;
    one tree per trace (and a span whose parent is missing starts a tree of its own)."""
    spans = [_span(row) for row in rows]
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    steps: list[Step] = []
    for trace_spans in sorted(by_trace.values(), key=lambda s: min(x["start"] for x in s)):
        origin = min(span["start"] for span in trace_spans)
        ids = {span["span_id"] for span in trace_spans}
        children: dict[str, list[dict[str, Any]]] = defaultdict(list)
        roots = []
        for span in sorted(trace_spans, key=lambda s: (s["start"], s["span_id"])):
            if span["parent"] in ids:
                children[span["parent"]].append(span)
            else:
                roots.append(span)
        stack = [(root, 0) for root in reversed(roots)]
        while stack:
            span, depth = stack.pop()
            steps.append(
                Step(
                    depth=depth,
                    offset_ms=(span["start"] - origin).total_seconds() * 1000,
                    duration_ms=span["duration_us"] / 1000,
                    name=span["name"],
                    service=span["service"],
                    status=span["status"],
                    attempt=span["attempt"],
                    trace_id=span["trace_id"],
                    attributes=span["attributes"],
                )
            )
            stack.extend((child, depth + 1) for child in reversed(children[span["span_id"]]))
    return steps


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _span(row: Mapping[str, Any]) -> dict[str, Any]:
    start = row["start_time"]
    if isinstance(start, str):  # through the query server, datetimes arrive as text
        start = datetime.fromisoformat(start)
    elif isinstance(start, int):  # as span_rows writes it: µs since the epoch
        start = _EPOCH + timedelta(microseconds=start)
    if start.tzinfo is None:
        start = start.replace(tzinfo=UTC)
    attrs = row.get("attributes") or {}
    return {
        "trace_id": row["trace_id"],
        "span_id": row["span_id"],
        "parent": row["parent_span_id"],
        "name": row["name"],
        "service": row["service"],
        "start": start,
        "duration_us": int(row["duration_us"]),
        "status": row["status"],
        "attempt": int(row["attempt"]),
        "attributes": tuple(sorted((str(k), str(v)) for k, v in attrs.items())),
    }


def render(steps: Sequence[Step]) -> str:
    """The timeline as text: one line per span, indented under its parent, with a bar
    placing it in the trace."""
    if not steps:
        return ""
    end = max(s.offset_ms + s.duration_ms for s in steps) or 1.0
    lines = []
    trace_id = None
    for step in steps:
        if step.trace_id != trace_id:
            trace_id = step.trace_id
            lines.append(f"trace {trace_id}")
        lo = round(40 * step.offset_ms / end)
        hi = max(lo + 1, round(40 * (step.offset_ms + step.duration_ms) / end))
        bar = " " * lo + "█" * (hi - lo)
        attempt = f" attempt {step.attempt}" if step.attempt > 0 else ""
        flag = " ERROR" if step.status == "error" else ""
        label = f"{'  ' * step.depth}{step.name}"
        lines.append(
            f"  {step.offset_ms:9.1f} ms {step.duration_ms:9.1f} ms  {label:<34} "
            f"{step.service:<18}|{bar:<40}|{attempt}{flag}"
        )
    return "\n".join(lines)
