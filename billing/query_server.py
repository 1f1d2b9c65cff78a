"""Read-only SQL over loopback HTTP, for the ClickHouse data this process owns.

A chdb data directory can be open in one process only, and the sink's process holds
it. So that process also answers queries for the CLI, tests and dashboards:

- ``POST /query`` with ``{"sql": "...", "parameters": {...}}`` --> ``{"rows": [...]}``;
  a refused statement or a ClickHouse error --> 400 ``{"error": "..."}``.
- ``GET /healthz`` --> ``{"status": "ok", "chdb_path": ..., **stats}``; readers compare
  ``chdb_path`` to make sure they reached the owner of *their* directory.
- ``GET /dashboard?tenant=&since=&until=`` --> the HTML dashboard (``billing.html``):
  every dashboard query (``billing/dashboards/*.sql``) for that window, as charts. Any
  other parameter a query declares (``limit``, ``bucket_tokens``) may be given too.
- ``GET /live?tenant=&limit=`` --> the live view (``billing.live``): per model the queue,
  TTFT p50/p99, tokens/s and workers, from the job's ``/metrics`` and the last minutes of
  usage rows; and the slowest requests of those minutes (of one tenant, or of all; 10,
  at most 100), each linked to its trace page. A malformed parameter --> 400.
- ``GET /trace/{request_id}?tenant=`` --> that request's traces as a timeline
  (``billing.traces``, ``billing.trace_page``); an id or tenant of the wrong shape --> 400,
  no spans --> 404, each with a page that says why.
- ``GET /metrics`` --> billing's own metrics (``billing.metrics``), when given a registry.

It binds 127.0.0.1 only. The store it is given must be opened ``read_only=True``: the
keyword check below only makes refusals clear, ClickHouse's readonly=1 enforces them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from aiohttp import web
from clickhouse_connect.driver.exceptions import ClickHouseError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from billing.html import render_dashboard, render_live
from billing.live import LIVE_SLOWEST, LIVE_TTFT, fetch_text, live_view, slowest_params
from billing.queries import QueryParamError, dashboard_queries
from billing.sql_guard import read_only_problem
from billing.storage import Queryable, Row, chdb_path
from billing.trace_page import render_problem, render_trace
from billing.traces import TRACE_SQL, lookup_problem, timeline
from tokenbus.metrics import start_metrics_server

STORE_KEY = web.AppKey("store", Queryable)
HEALTH_KEY: web.AppKey[Callable[[], dict[str, Any]]] = web.AppKey("health")
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
JOB_METRICS_KEY = web.AppKey("job_metrics", str)
BATCH_METRICS_KEY = web.AppKey("batch_metrics", str)


def create_app(
    store: Queryable,
    *,
    dsn: str,
    stats: Callable[[], Mapping[str, int]] | None = None,
    registry: CollectorRegistry | None = None,
    job_metrics_url: str | None = None,
    batch_metrics_url: str | None = None,
) -> web.Application:
    path = chdb_path(dsn)
    owned_path = os.path.realpath(path) if path is not None else None

    def health() -> dict[str, Any]:
        return {"status": "ok", "chdb_path": owned_path, **(stats() if stats else {})}

    app = web.Application()
    app[STORE_KEY] = store
    app[HEALTH_KEY] = health
    app.router.add_post("/query", _query)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/dashboard", _dashboard)
    app.router.add_get("/live", _live)
    app.router.add_get("/trace/{request_id}", _trace)
    app[JOB_METRICS_KEY] = job_metrics_url or ""
    app[BATCH_METRICS_KEY] = batch_metrics_url or ""
    if registry is not None:
        app[REGISTRY_KEY] = registry
        app.router.add_get("/metrics", _metrics)
    return app


async def _metrics(request: web.Request) -> web.Response:
    response = web.Response(body=generate_latest(request.app[REGISTRY_KEY]))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def _live(request: web.Request) -> web.Response:
    """The job's metrics (its queue, and the workers' heartbeats it holds) and the TTFT
    of the usage rows created in the last few minutes, and the slowest of those requests;
    a source that fails is named."""
    now = datetime.now(UTC)
    sql, values = LIVE_TTFT.to_sql({})
    try:  # the slowest requests are the tail of the TTFT above: same rows, same window
        slowest = slowest_params(request.query, window_s=values["window_s"])
    except QueryParamError as exc:
        return web.Response(status=400, text=f"{exc}\n")
    errors: dict[str, str] = {}
    url = request.app[JOB_METRICS_KEY]
    job_text = ""
    if not url:
        errors["job"] = "no job metrics URL (TOKENBUS_JOB_METRICS_URL or FAUST_WEB_PORT)"
    else:
        try:
            job_text = await asyncio.to_thread(fetch_text, url)
        except OSError as exc:
            errors["job"] = f"{url}: {exc}"
    store = request.app[STORE_KEY]
    try:
        ttft_rows = await asyncio.to_thread(store.query, sql, values)
    except ClickHouseError as exc:
        errors["ttft"] = str(exc).splitlines()[0]
        ttft_rows = []
    try:
        slowest_rows = await asyncio.to_thread(store.query, *LIVE_SLOWEST.to_sql(slowest))
    except ClickHouseError as exc:
        errors["slowest"] = str(exc).splitlines()[0]
        slowest_rows = []
    batch_text = ""
    if request.app[BATCH_METRICS_KEY]:
        try:
            batch_text = await asyncio.to_thread(fetch_text, request.app[BATCH_METRICS_KEY])
        except OSError as exc:
            errors["batches"] = f"{request.app[BATCH_METRICS_KEY]}: {exc}"
    view = live_view(job_text, ttft_rows, batch_text, slowest_rows, slowest["tenant"])
    page = render_live(view, generated_at=now, errors=errors)
    return web.Response(text=page, content_type="text/html")


async def _trace(request: web.Request) -> web.Response:
    """One request's traces, from the spans this process stores (``billing.span_sink``)."""
    now = datetime.now(UTC)
    request_id = request.match_info["request_id"]
    tenant = request.query.get("tenant", "")
    problem = lookup_problem(request_id, tenant)
    if problem is not None:
        return _page(400, render_problem("bad request", problem, generated_at=now))
    parameters = {"tenant": tenant, "request_id": request_id}
    try:
        rows = await asyncio.to_thread(request.app[STORE_KEY].query, TRACE_SQL, parameters)
    except ClickHouseError as exc:
        message = f"the span store failed: {str(exc).splitlines()[0]}"
        return _page(500, render_problem("span store error", message, generated_at=now))
    steps = timeline(rows)
    if not steps:
        message = (
            f"no spans of request {request_id} for tenant {tenant}: spans arrive within a few "
            "seconds and are kept 7 days; a request that was not sampled has none "
            "(TOKENBUS_TRACE_SAMPLE_RATIO), and with TOKENBUS_OTLP_ENDPOINT set they go to "
            "the collector instead"
        )
        return _page(404, render_problem("no trace", message, generated_at=now))
    return _page(200, render_trace(request_id, tenant, steps, generated_at=now))


def _page(status: int, html: str) -> web.Response:
    return web.Response(status=status, text=html, content_type="text/html")


async def start_query_server(app: web.Application, port: int) -> web.AppRunner:
    """Serves ``app`` on 127.0.0.1:``port``; the caller awaits ``runner.cleanup()``."""
    runner: web.AppRunner = await start_metrics_server(app, "127.0.0.1", port)
    return runner


async def _healthz(request: web.Request) -> web.Response:
    return _json(request.app[HEALTH_KEY]())


async def _query(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _error(f"the body is not JSON: {exc}")
    if not isinstance(body, dict) or not isinstance(body.get("sql"), str):
        return _error('expected {"sql": "...", "parameters": {...}}')
    sql: str = body["sql"]
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        return _error('"parameters" must be a JSON object')
    problem = read_only_problem(sql)
    if problem is not None:
        return _error(problem)
    store = request.app[STORE_KEY]
    try:
        # Off the event loop: the sink's batches share it, and the client call blocks.
        rows = await asyncio.to_thread(store.query, sql, parameters)
    except ClickHouseError as exc:
        return _error(str(exc))
    try:
        return _json({"rows": rows})
    except orjson.JSONEncodeError as exc:  # e.g. an Int128 beyond JSON's 64-bit range
        return _error(f"a result value cannot be sent as JSON: {exc}")


DASHBOARD_WINDOW = timedelta(hours=24)
"""What the dashboard shows when the URL names no window: the last day."""
DASHBOARD_DEFAULTS = {"limit": "10"}
"""Page-sized values for query parameters the URL does not give (top 10 sessions)."""


def dashboard_filters(query: Mapping[str, str], now: datetime) -> dict[str, str]:
    """The window and tenant the page shows: the URL's values, else the last day."""
    filters = {
        "tenant": "",
        "since": (now - DASHBOARD_WINDOW).strftime("%Y-%m-%d %H:%M:00"),
        "until": (now + timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:00"),
    }
    filters.update({key: value for key, value in query.items() if key in filters})
    return filters


async def _dashboard(request: web.Request) -> web.Response:
    now = datetime.now(UTC)
    filters = dashboard_filters(request.query, now)
    store = request.app[STORE_KEY]
    results: dict[str, list[Row]] = {}
    errors: dict[str, str] = {}
    for name, query in dashboard_queries().items():
        declared = {param.name for param in query.params}
        given = {**DASHBOARD_DEFAULTS, **request.query, **filters}
        chosen = {k: v for k, v in given.items() if k in declared}
        sql, values = query.to_sql(chosen)
        try:
            results[name] = await asyncio.to_thread(store.query, sql, values)
        except ClickHouseError as exc:
            errors[name] = str(exc).splitlines()[0]
    page = render_dashboard(results, filters, generated_at=now, errors=errors)
    return web.Response(text=page, content_type="text/html")


def _json(payload: Any, status: int = 200) -> web.Response:
    body = orjson.dumps(payload, default=_jsonable, option=orjson.OPT_NON_STR_KEYS)
    return web.Response(body=body, status=status, content_type="application/json")


def _error(message: str) -> web.Response:
    return _json({"error": message}, status=400)


def _jsonable(value: Any) -> Any:
    # orjson handles datetimes, dates, UUIDs and containers; what is left (Decimal,
    # IP addresses, bytes) travels as text so that no digit is rounded on the way.
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, set | frozenset):
        return list(value)
    return str(value)
