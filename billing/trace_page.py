"""A request's trace as an HTML page: ``billing.traces.timeline``'s steps --> bars on a
time axis, one table per trace. Pure, like ``billing.html``.

Every value on the page came from outside (span names and attributes from services,
the request id and tenant from the URL), so each is escaped; the page has no script.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from html import escape
from itertools import groupby

from billing.html import STYLE
from billing.svg import nice_ticks
from billing.traces import Step
from tokenbus.tracing import ATTR_REQUEST, ATTR_TENANT

_TRACE_STYLE = """
main{display:block}
.card{margin-bottom:16px}
td.span{white-space:nowrap}
td.attrs{text-align:left;color:#4b5563;font-size:11px}
td.attrs code{margin-right:8px}
td.lane,th.lane{width:45%;position:relative;text-align:left}
.lane div.bar{height:12px;background:#2563eb;border-radius:2px;min-width:2px}
.lane div.bar.error{background:#dc2626}
.axis{position:relative;height:14px}
.axis span{position:absolute;transform:translateX(-50%);font-weight:normal;color:#6b7280}
.axis span:first-child{transform:none}
"""
_ATTR_PREFIX = "tokenbus."


def render_trace(
    request_id: str, tenant: str, steps: Sequence[Step], *, generated_at: datetime
) -> str:
    """The page of ``request_id``'s traces (``steps`` as ``timeline`` orders them): per
    span its service, name, start, duration, attempt and attributes, and a bar placing it
    on its trace's time axis. Both attempts of a resumed request share its trace."""
    cards = [
        _trace_card(trace_id, list(trace_steps), request_id)
        for trace_id, trace_steps in groupby(steps, key=lambda s: s.trace_id)
    ]
    title = f"request {request_id} of tenant {tenant}"
    return _page(f"tokenbus trace: {title}", title, "".join(cards), generated_at)


def render_problem(title: str, message: str, *, generated_at: datetime) -> str:
    """A page that says why there is no trace to show (a 400 or a 404)."""
    body = f'<section class="card"><p class="error">{escape(message)}</p></section>'
    return _page(f"tokenbus trace: {title}", title, body, generated_at)


def _page(head_title: str, title: str, body: str, generated_at: datetime) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(head_title)}</title>"
        f"<style>{STYLE}{_TRACE_STYLE}</style></head><body>"
        f"<header><h1>{escape(title)}</h1>"
        '<a href="../live" style="color:#93c5fd">live view</a>'
        '<a href="../dashboard" style="color:#93c5fd">billing</a>'
        f"<span>as of {escape(generated_at.strftime('%Y-%m-%d %H:%M:%S UTC'))}</span></header>"
        f"<main>{body}</main></body></html>"
    )


def _trace_card(trace_id: str, steps: list[Step], request_id: str) -> str:
    end = max(s.offset_ms + s.duration_ms for s in steps) or 1.0
    ticks = nice_ticks(end, count=4)
    scale = ticks[-1] or 1.0
    axis = "".join(f'<span style="left:{100 * t / scale:.2f}%">{t:g} ms</span>' for t in ticks[:-1])
    head = (
        "<tr><th>span</th><th>service</th><th>start ms</th><th>duration ms</th>"
        f'<th>attempt</th><th class="lane"><div class="axis">{axis}</div></th>'
        "<th>attributes</th></tr>"
    )
    rows = "".join(_step_row(step, scale, request_id) for step in steps)
    attempts = sorted({s.attempt for s in steps if s.attempt >= 0})
    shown = ", ".join(str(a) for a in attempts) or "-"
    spans = f"{len(steps)} span{'' if len(steps) == 1 else 's'}"
    note = (
        f"{spans} over {end:,.1f} ms, from its first span's start; attempts {shown}. "
        "Indented under their parents."
    )
    return (
        f'<section class="card"><h2>trace {escape(trace_id)}</h2>'
        f'<p class="note">{escape(note)}</p><table>{head}{rows}</table></section>'
    )


def _step_row(step: Step, scale: float, request_id: str) -> str:
    left = 100 * step.offset_ms / scale
    width = 100 * step.duration_ms / scale
    error = " error" if step.status == "error" else ""
    bar = f'<div class="bar{error}" style="margin-left:{left:.2f}%;width:{width:.2f}%"></div>'
    indent = "&nbsp;" * (2 * step.depth)
    flag = ' <b class="error">error</b>' if error else ""
    attrs = " ".join(
        f"<code>{escape(name.removeprefix(_ATTR_PREFIX))}={escape(value)}</code>"
        for name, value in step.attributes
        if name != ATTR_TENANT and not (name == ATTR_REQUEST and value == request_id)
    )
    return (
        f'<tr><td class="span">{indent}{escape(step.name)}{flag}</td>'
        f"<td>{escape(step.service)}</td><td>{step.offset_ms:,.1f}</td>"
        f"<td>{step.duration_ms:,.1f}</td>"
        f"<td>{step.attempt if step.attempt >= 0 else '-'}</td>"
        f'<td class="lane">{bar}</td><td class="attrs">{attrs}</td></tr>'
    )
