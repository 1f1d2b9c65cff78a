"""The Starlette app: routes, error handling, the ID/metrics middleware and the lifespan.

# lifespan --> TokenbusClient (this instance's own reply topic) + heartbeat follower
# every response --> X-Session-ID / X-Request-ID (new ones when the handler set none)
# ApiError, Starlette's HTTPException (404, 405, a malformed form) --> OpenAI's error body

Each bridge instance owns one reply topic, so instances scale out independently and a
restart of one never touches the streams of another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from aiokafka import TopicPartition
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bridge.admin import admin_routes, check_admin_key
from bridge.admission import Planner
from bridge.auth import Authenticator
from bridge.batch_api import BatchApi
from bridge.errors import ApiError
from bridge.gateway import Bus, ClientGone, Gateway, ids_of
from bridge.hygiene import PatternScreen
from bridge.metrics import CONTENT_TYPE_LATEST, BridgeMetrics
from bridge.openapi import build_spec
from bridge.served_models import ServedModels
from bridge.sessions import SessionIssuer
from bridge.throttle import KeyThrottle
from producers import TokenbusClient
from schemas import SchemaError, WorkerStatus, decode
from schemas.openai_api import Health, ModelCard, ModelList
from tokenbus.auth import ServiceTokens
from tokenbus.config import Settings
from tokenbus.ids import new_request_id, new_session_id
from tokenbus.kafka import make_consumer
from tokenbus.metrics import ConsumerLagCollector, aiokafka_offsets, create_tenant_labels
from tokenbus.prompt_tokens import PromptCounter
from tokenbus.topics import Topics
from tokenbus.tracing import Tracing

log = logging.getLogger(__name__)
ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/files",
        "/v1/batches",
        "/healthz",
        "/metrics",
    }
)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


class IdsAndMetrics:
    """Adds X-Session-ID/X-Request-ID to every response that lacks them (401s, 404s,
    /healthz) and counts responses by endpoint and status. Pure ASGI, so streaming and
    disconnect handling pass through untouched."""

    def __init__(self, app: ASGIApp, metrics: BridgeMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        # When the request reached the app: the start of its trace's bridge.request span.
        scope.setdefault("state", {})["received_ns"] = time.time_ns()
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers: list[tuple[bytes, bytes]] = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                if b"x-session-id" not in names:
                    headers.append((b"x-session-id", new_session_id().encode()))
                if b"x-request-id" not in names:
                    headers.append((b"x-request-id", new_request_id().encode()))
                message = {**message, "headers": headers}
                self._metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self._app(scope, receive, send_with_ids)


def create_app(settings: Settings, bus: Bus | None = None) -> Starlette:
    """The bridge; ``bus`` defaults to a TokenbusClient started with the app."""
    metrics = BridgeMetrics(
        tenants=create_tenant_labels(
            settings.metrics_top_tenants, settings.metrics_tenant_half_life_s
        )
    )
    served = ServedModels(
        settings.served_model_name,
        dead_after_s=settings.worker_dead_after_s,
        configured=settings.bridge_models,
    )
    if not settings.bus_service_secret:
        raise SystemExit(
            "the bridge needs TOKENBUS_BUS_SERVICE_SECRET (shared with the Faust job): "
            "it vouches with it for the tenants it authenticates"
        )
    directory = settings.tenant_directory()
    tokens = ServiceTokens(settings.bus_service_secret)
    tracing = Tracing(settings, "bridge")
    # Its cancels carry service tokens; its producer sends the bridge's spans, and each
    # request carries the bridge's span to the job (the bridge's own spans time it).
    client = bus or TokenbusClient(settings, tracing=tracing, request_spans=False)
    authenticator = Authenticator(
        directory,
        audience=settings.jwt_audience,
        hs256_secret=settings.jwt_hs256_secret,
        rs256_public_key=settings.jwt_rs256_public_key,
        allow_unlisted_tenants=settings.allow_unlisted_tenants,
        leeway_s=settings.jwt_leeway_s,
        topics=Topics(settings.topic_prefix),
    )
    planner = Planner(
        PatternScreen.create(
            settings.bridge_injection_patterns, settings.bridge_sensitive_patterns
        ),
        PromptCounter.from_model_dir(settings.model_dir),
        max_prompt_chars=settings.bridge_max_prompt_chars,
        knows_model=lambda model: served.knows(model, time.monotonic()),
    )
    gateway = Gateway(
        settings,
        client,
        authenticator,
        KeyThrottle(settings.bridge_key_rate_per_s, settings.bridge_key_burst),
        SessionIssuer.create(settings.bridge_session_secret),
        planner,
        metrics,
        tokens,
        tracing.tracer,
    )
    batch_api = BatchApi(settings, gateway, planner)
    spec = build_spec(settings.served_model_name)
    lag = ConsumerLagCollector()
    metrics.registry.register(lag)
    if bus is None:
        lag.track("replies", aiokafka_offsets(lambda: getattr(client, "reply_consumer", None)))

    async def models(http: Request) -> Response:
        caller = gateway.authenticate(http)
        cards = [
            ModelCard(id=name, created=0)
            for name in served.names_for(caller.tenant, time.monotonic())
        ]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"), headers=ids_of(http))

    async def healthz(http: Request) -> Response:
        health = Health(status="ok", reply_topic=client.reply_topic)
        return JSONResponse(health.model_dump(mode="json"))

    async def prometheus(http: Request) -> Response:
        # Every tenant's name and model, adapters included: the operator's, not a caller's.
        check_admin_key(settings, http, "/metrics")
        return Response(metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(http: Request) -> Response:
        return JSONResponse(spec)

    async def api_error(http: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), exc.status, headers={**exc.headers, **ids_of(http)})

    async def http_error(http: Request, exc: Exception) -> Response:
        # Starlette's own refusals (no route, a method the route lacks, a form it cannot
        # parse) answer in the same shape as the bridge's, so a client parses one body.
        assert isinstance(exc, HTTPException)
        error = _starlette_error(http, exc)
        return JSONResponse(error.body(), error.status, headers={**error.headers, **ids_of(http)})

    async def client_gone(http: Request, exc: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST, headers=ids_of(http))

    async def internal_error(http: Request, exc: Exception) -> Response:
        # Starlette answers this outside the middleware, so the IDs are set here too.
        log.error("unhandled error on %s", http.url.path, exc_info=exc)
        ids = {"X-Session-ID": new_session_id(), "X-Request-ID": new_request_id()}
        error = ApiError(500, "Internal error; retry later.", type="server_error", code="internal")
        return JSONResponse(error.body(), 500, headers={**ids, **ids_of(http)})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if bus is None:
            await client.start()  # type: ignore[attr-defined]
        await batch_api.start()
        follower = asyncio.create_task(_follow_heartbeats(settings, served))
        log.info("bridge ready on %s:%d", settings.bridge_host, settings.bridge_port)
        try:
            yield
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await batch_api.stop()
            if bus is None:
                await client.close()  # type: ignore[attr-defined]

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
            Route("/v1/completions", gateway.completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"], include_in_schema=False),
            *batch_api.routes(),
            *admin_routes(settings),
        ],
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            ClientGone: client_gone,
            Exception: internal_error,
        },
        lifespan=lifespan,
    )
    app.add_middleware(IdsAndMetrics, metrics=metrics)
    return app


def _starlette_error(http: Request, exc: HTTPException) -> ApiError:
    headers = dict(exc.headers or {})  # a 405's Allow
    if exc.status_code == 404:
        message = f"Invalid URL ({http.method} {http.url.path})."
        return ApiError(404, message, type="invalid_request_error", code="not_found")
    if exc.status_code == 405:
        message = f"{http.method} is not allowed on {http.url.path}."
        return ApiError(
            405, message, type="invalid_request_error", code="method_not_allowed", headers=headers
        )
    # A 400 is a body Starlette could not parse (a multipart form without names or bounds).
    code = "invalid_body" if exc.status_code == 400 else None
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return ApiError(exc.status_code, exc.detail, type=type_, code=code, headers=headers)


async def _follow_heartbeats(settings: Settings, served: ServedModels) -> None:
    """Every heartbeat, no group: the served models are known to every bridge instance."""
    topic = Topics(settings.topic_prefix).heartbeats
    # No request waits on it: the longer background wait polls the broker less.
    consumer = make_consumer(settings, group_id=None, background=True, auto_offset_reset="latest")
    await consumer.start()
    try:
        await consumer.topics()
        partitions = consumer.partitions_for_topic(topic) or {0}
        consumer.assign([TopicPartition(topic, p) for p in partitions])
        async for record in consumer:
            try:
                status = decode(WorkerStatus, record.value)
            except SchemaError:
                continue  # the job logs malformed heartbeats; one report is enough
            if not status.draining:
                served.observe(status, time.monotonic())
    finally:
        await consumer.stop()
