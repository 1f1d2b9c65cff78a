"""The built-in HTML dashboard: the dashboard queries' rows --> one self-contained page.

Pure: the query server runs the queries (``billing.queries``) and hands the rows here.
Charts are inline SVG (``billing.svg``) and the style is inline, so the page needs no
network and no script. Values may be Decimals (a store read directly) or decimal text
(rows that crossed the query server's JSON); both are read as floats for drawing only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from html import escape
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from billing.svg import Series, bar_chart, compact, hbar_chart, line_chart

if TYPE_CHECKING:
    from billing.live import LiveView, SlowRequest

Rows = Sequence[Mapping[str, Any]]
MAX_LINE_POINTS = 240
"""Longer minute series are drawn as means over steps of several minutes."""

STYLE = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;
background:#f5f6f8;color:#111827}
header{background:#111827;color:#f9fafb;padding:14px 24px;display:flex;
align-items:center;gap:24px;flex-wrap:wrap}
header h1{font-size:18px;margin:0}
form{display:flex;gap:8px;align-items:center;flex-wrap:wrap}
form input{padding:4px 6px;border-radius:4px;border:1px solid #4b5563;width:150px}
form button{padding:4px 12px}
main{padding:16px 24px;display:grid;grid-template-columns:repeat(auto-fit,minmax(620px,1fr));
gap:16px}
.card{background:#fff;border-radius:8px;padding:12px 16px;box-shadow:0 1px 2px #0001}
.card h2{font-size:15px;margin:0 0 8px}
.card p.note{color:#6b7280;margin:0 0 8px;font-size:12px}
.totals{display:flex;gap:28px;flex-wrap:wrap;grid-column:1/-1}
.total b{display:block;font-size:22px}
.total span{color:#6b7280;font-size:12px}
table{border-collapse:collapse;width:100%;font-size:12px;margin-top:8px}
th,td{padding:3px 6px;border-bottom:1px solid #e5e7eb;text-align:right}
th:first-child,td:first-child{text-align:left}
svg .grid{stroke:#e5e7eb}
svg .tick,svg .label,svg .value{font-size:11px;fill:#4b5563}
.legend{display:flex;gap:12px;flex-wrap:wrap;font-size:12px;margin-top:4px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
.error{color:#b91c1c}
"""


def render_dashboard(
    results: Mapping[str, Rows],
    filters: Mapping[str, str],
    *,
    generated_at: datetime,
    errors: Mapping[str, str] | None = None,
) -> str:
    """The page for ``results`` keyed by dashboard query name; missing ones show as empty."""
    errors = errors or {}

    def rows(name: str) -> Rows:
        return results.get(name, [])

    cards = [
        _totals(rows("spend_by_tenant_per_day"), rows("failed_cancelled_share")),
        *(
            _card(title, subtitle, draw(rows(name)), errors.get(name))
            for name, title, subtitle, draw in _CARDS
        ),
    ]
    form = "".join(
        f'<label>{escape(name)} <input name="{escape(name)}" value="{escape(value)}"></label>'
        for name, value in filters.items()
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        "<title>tokenbus billing</title>"
        f"<style>{STYLE}</style></head><body>"
        f"<header><h1>tokenbus billing</h1><form method=get>{form}"
        '<button>show</button></form><a href="live" style="color:#93c5fd">live view</a>'
        f"<span>as of {escape(generated_at.strftime('%Y-%m-%d %H:%M:%S UTC'))}</span></header>"
        f"<main>{''.join(cards)}</main></body></html>"
    )


def number(value: Any) -> float:
    if value is None:
        return 0.0
    return float(value) if isinstance(value, int | float | Decimal) else float(str(value))


def money(value: float) -> str:
    return f"{value:,.4f}" if abs(value) < 1000 else f"{value:,.0f}"


def _card(title: str, note: str, body: str, error: str | None) -> str:
    shown = f'<p class="error">{escape(error)}</p>' if error else body
    heading = f'<h2>{escape(title)}</h2><p class="note">{escape(note)}</p>'
    return f'<section class="card">{heading}{shown}</section>'


def _totals(spend: Rows, share: Rows) -> str:
    overall = next((r for r in share if r.get("tenant") == "*"), None)
    tokens = sum(number(r["prompt_tokens"]) + number(r["completion_tokens"]) for r in spend)
    figures = [
        (money(sum(number(r["billed_units"]) for r in spend)), "billed cost units"),
        (money(sum(number(r["cost_units"]) for r in spend)), "cost at list price"),
        (f"{int(sum(number(r['num_attempts']) for r in spend)):,}", "request attempts"),
        (f"{int(tokens):,}", "tokens"),
        (
            f"{number(overall['cost_share']):.1%}" if overall else "-",
            "of the cost went to failed or cancelled work",
        ),
    ]
    items = "".join(
        f'<div class="total"><b>{escape(v)}</b><span>{escape(k)}</span></div>' for v, k in figures
    )
    return f'<section class="card totals">{items}</section>'


def _pivot(rows: Rows, x: str, series: str, value: str) -> tuple[list[str], list[Series]]:
    """Rows of (x, series, value) --> shared x labels and one Series per name, 0 if absent."""
    labels = sorted({str(r[x]) for r in rows})
    names = sorted({str(r[series]) for r in rows})
    cells = {(str(r[x]), str(r[series])): number(r[value]) for r in rows}
    return labels, [Series(n, [cells.get((label, n), 0.0) for label in labels]) for n in names]


def _spend(rows: Rows) -> str:
    days, series = _pivot(rows, "day", "tenant_id", "billed_units")
    return bar_chart(days, series, stacked=True, fmt=compact)


def _tokens(rows: Rows) -> str:
    minutes, series = _pivot(rows, "minute", "tenant_id", "total_tokens")
    step = max(1, -(-len(minutes) // MAX_LINE_POINTS))
    if step > 1:
        minutes = minutes[::step]
        series = [
            Series(
                s.name, [sum(s.values[i : i + step]) / step for i in range(0, len(s.values), step)]
            )
            for s in series
        ]
    labels = [m[11:16] if len(m) >= 16 else m for m in minutes]  # hh:mm of the ISO time
    note = f"<p class=note>means over {step}-minute steps</p>" if step > 1 else ""
    return line_chart(labels, series) + note


def _sessions(rows: Rows) -> str:
    labels = [f"{r['tenant_id']} / {r['session_id']}" for r in rows]
    chart = hbar_chart(labels, [number(r["billed_units"]) for r in rows], fmt=money)
    return chart + _table(
        rows, ("tenant_id", "session_id", "billed_units", "num_attempts", "num_failed")
    )


def _batches(rows: Rows) -> str:
    if not rows:
        return '<p class="note">no batch lines in this window</p>'
    labels = [f"{r['tenant_id']} / {r['batch_id']}" for r in rows]
    chart = hbar_chart(labels, [number(r["billed_units"]) for r in rows], fmt=money)
    columns = ("tenant_id", "batch_id", "billed_units", "num_attempts", "num_failed")
    return chart + _table(rows, (*columns, "prompt_tokens", "completion_tokens"))


def _share(rows: Rows) -> str:
    tenants = [r for r in rows if r.get("tenant") != "*"]
    chart = hbar_chart(
        [str(r["tenant"]) for r in tenants],
        [number(r["cost_share"]) for r in tenants],
        fmt=lambda v: f"{v:.1%}",
        maximum=1.0,
    )
    return chart + _table(
        rows,
        ("tenant", "total_attempts", "failed_attempts", "cancelled_attempts", "cost_share"),
        percent=("cost_share",),
    )


def _context(rows: Rows) -> str:
    labels = [f"{_tokens_label(r['context_from'])}-{_tokens_label(r['context_to'])}" for r in rows]
    chart = bar_chart(
        labels, [Series("cost per 1k tokens", [number(r["cost_per_1k_tokens"]) for r in rows])]
    )
    return chart + _table(
        rows, ("context_from", "num_attempts", "tokens", "cost_per_1k_tokens", "mean_cost_weight")
    )


def _tokens_label(value: Any) -> str:
    tokens = int(number(value))
    return f"{tokens // 1024}k" if tokens % 1024 == 0 and tokens else str(tokens)


def _ttft(rows: Rows) -> str:
    labels = [f"{r['tenant_id']} p{r['priority']}" for r in rows]
    chart = bar_chart(
        labels,
        [
            Series("p50 ms", [number(r["p50_ttft_ms"]) for r in rows]),
            Series("p99 ms", [number(r["p99_ttft_ms"]) for r in rows]),
        ],
    )
    return chart + _table(
        rows, ("tenant_id", "priority", "num_attempts", "p50_ttft_ms", "p99_ttft_ms")
    )


def _alerts(rows: Rows) -> str:
    if not rows:
        return '<p class="note">no budget alerts in this window</p>'
    shown = [
        {
            **r,
            "fired_at": str(r["fired_at"])[:19].replace("T", " "),
            "threshold": f"{int(number(r['threshold']))}%",
            "spent / limit": f"{r['spent_units']} / {r['limit_units']}",
        }
        for r in rows
    ]
    columns = ("tenant_id", "fired_at", "budget_id", "threshold", "reason", "spent / limit")
    return _table(shown, columns)


def _table(
    rows: Rows, columns: Sequence[str], percent: Sequence[str] = (), markup: Sequence[str] = ()
) -> str:
    """``rows`` under ``columns``, every value escaped but those of ``markup`` columns,
    which hold HTML built (and escaped) by this module."""
    if not rows:
        return ""
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{r.get(c)}</td>"
            if c in markup
            else f"<td>{escape(_cell(r.get(c), c in percent))}</td>"
            for c in columns
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any, percent: bool) -> str:
    if percent:
        return f"{number(value):.1%}"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, Decimal):
        return money(float(value))
    return str(value)


LIVE_REFRESH_S = 5


def trace_href(tenant: str, request_id: str) -> str:
    """The trace page of a request, relative to the live view (``/live`` --> ``/trace/..``);
    both values URL-encoded, so neither can leave its place in the URL."""
    return f"trace/{quote(request_id, safe='')}?tenant={quote(tenant, safe='')}"


def render_live(
    view: LiveView, *, generated_at: datetime, errors: Mapping[str, str] | None = None
) -> str:
    """The live view (``billing.live``): per model and per worker, reloading itself."""
    errors = errors or {}
    models = [
        {
            "model": m.model,
            "queued in the job": int(m.num_queued),
            "waiting": int(m.num_waiting),
            "running": int(m.num_running),
            "TTFT p50 ms": _optional(m.p50_ttft_ms),
            "TTFT p99 ms": _optional(m.p99_ttft_ms),
            "tokens/s": round(m.tokens_per_s, 1),
            "workers": int(m.num_workers),
            "recommended": "-" if m.num_recommended is None else int(m.num_recommended),
        }
        for m in view.models
    ]
    workers = [
        {
            "worker": w.worker,
            "model": w.model,
            "running": int(w.num_running),
            "waiting": int(w.num_waiting),
            "KV use": w.kv_cache_usage,
            "tokens/s": round(w.tokens_per_s, 1),
        }
        for w in view.workers
    ]
    batches = [
        {
            "tenant": b.tenant,
            "batch": b.batch,
            "done": b.num_completed,
            "failed": b.num_failed,
            "remaining": b.num_remaining,
            "in flight": b.num_in_flight,
            "tokens in / out": f"{b.prompt_tokens} / {b.completion_tokens}",
            "ETA s": "-" if b.eta_s is None else round(b.eta_s),
        }
        for b in view.batches
    ]
    problems = "".join(
        f'<p class="error">{escape(source)}: {escape(message)}</p>'
        for source, message in sorted(errors.items())
    )
    whose = f"tenant {view.slowest_tenant}" if view.slowest_tenant else "every tenant"
    cards = [
        _card(
            "Models",
            "Queue and running from the job's metrics (its queue, and its workers' "
            "heartbeats); TTFT from the usage rows of the last 5 minutes; tokens/s the "
            "workers' own.",
            _table(models, list(models[0]) if models else []) or "<p>no model live</p>",
            None,
        ),
        _card(
            "Workers",
            "Each live worker's last heartbeat, as the job holds it.",
            _table(workers, list(workers[0]) if workers else [], percent=["KV use"])
            or "<p>no worker live</p>",
            None,
        ),
        _card(
            "Batches",
            "Each batch the runner drives now (its /metrics): lines done, failed, "
            "remaining and in flight, tokens, and the time to completion at the recent pace.",
            _table(batches, list(batches[0]) if batches else []) or "<p>no batch running</p>",
            None,
        ),
        _card(
            "Slowest recent requests",
            f"Of {whose}: the requests created in the last 5 minutes ranked by TTFT (the "
            "TTFT above, from the request's creation to its first token), slowest first; "
            "duration from its creation to its last attempt's end; tokens and attempts "
            "over all its attempts; status its last attempt's. A request with no token "
            "is not ranked. ?tenant= and ?limit= (at most 100) choose; a trace shows "
            "spans only if the request was sampled.",
            _slowest(view.slowest),
            None,
        ),
    ]
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{LIVE_REFRESH_S}">'
        "<title>tokenbus live</title>"
        f"<style>{STYLE}</style></head><body>"
        '<header><h1>tokenbus live</h1><a href="dashboard" style="color:#93c5fd">billing</a>'
        f"<span>as of {escape(generated_at.strftime('%Y-%m-%d %H:%M:%S UTC'))}</span></header>"
        f"<main>{problems}{''.join(cards)}</main></body></html>"
    )


def _slowest(slowest: Sequence[SlowRequest]) -> str:
    rows = [
        {
            "tenant": r.tenant,
            "request": r.request_id,
            "model": r.model,
            "TTFT ms": f"{r.ttft_ms:,.1f}",
            "duration ms": f"{r.duration_ms:,.1f}",
            "tokens in / out": f"{r.num_prompt_tokens} / {r.num_completion_tokens}",
            "attempts": r.num_attempts,
            "status": r.status,
            "trace": f'<a href="{escape(trace_href(r.tenant, r.request_id))}">trace</a>',
        }
        for r in slowest
    ]
    return _table(rows, list(rows[0]), markup=["trace"]) if rows else "<p>no request</p>"


def _optional(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


_CARDS: list[tuple[str, str, str, Callable[[Rows], str]]] = [
    (
        "spend_by_tenant_per_day",
        "Spend by tenant per day",
        "Billed cost units, stacked by tenant.",
        _spend,
    ),
    (
        "tokens_per_minute_by_tenant",
        "Tokens per minute by tenant",
        "Prompt + completion tokens of the requests created in each minute.",
        _tokens,
    ),
    (
        "top_sessions_by_cost",
        "Top sessions by cost",
        "Billed cost units of the costliest sessions active in the window.",
        _sessions,
    ),
    (
        "failed_cancelled_share",
        "Share of failed and cancelled work",
        "Share of the work's cost (list price, whatever was billed) spent on attempts "
        "that failed or were cancelled.",
        _share,
    ),
    (
        "cost_per_1k_by_context_bucket",
        "Cost per 1k tokens by context length",
        "List-price cost per 1,000 tokens, by prompt length; long context weighs more.",
        _context,
    ),
    (
        "ttft_by_tenant_and_priority",
        "p50 and p99 TTFT by tenant and priority",
        "Time to first token in ms, from the request's creation (0 VIP, 1 standard, 2 batch).",
        _ttft,
    ),
    (
        "spend_per_batch",
        "Spend per batch",
        "Billed cost units of each batch job's lines (at the batch price), costliest first.",
        _batches,
    ),
    (
        "recent_budget_alerts",
        "Recent budget alerts",
        "Each budget alert fired in the window, newest first per tenant: the threshold "
        "reached (a hard budget's first refusal is its 100%) and the spend then.",
        _alerts,
    ),
]
"""(dashboard query, title, what it shows, the chart or table it draws), in page order."""
