"""The bridge's admin API: budgets, for an operator holding ``Settings.admin_key``.

    PUT    /admin/budgets              body: a BudgetConfig (tokenbus.budget_config)
    DELETE /admin/budgets/{budget_id}
    GET    /admin/budgets              the job's spend per budget (its /budgets)

A tenant's key or token is never an admin credential: only the admin key, compared in
constant time. With no admin key configured the routes answer 404, as if absent. The
bridge's ``/metrics`` (every tenant's name and model) is the operator's the same way.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bridge.errors import ApiError, invalid_request, unauthorized
from tokenbus.budget_admin import budget_record, job_budgets, publish_budget_change
from tokenbus.budget_config import BudgetConfig, parse_budget_id
from tokenbus.config import Settings

PublishChange = Callable[[Settings, bytes, bytes | None], Awaitable[None]]


def check_admin_key(settings: Settings, http: Request, what: str = "The admin API") -> None:
    """404 with no admin key configured, 401 unless the bearer is the admin key."""
    if not settings.admin_key:
        raise ApiError(404, "Not found.", type="invalid_request_error", code="not_found")
    scheme, _, given = http.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), settings.admin_key.encode()
    ):
        raise unauthorized(f"{what} takes the admin key only.")


def admin_routes(settings: Settings, publish: PublishChange = publish_budget_change) -> list[Route]:
    def check(http: Request) -> None:
        check_admin_key(settings, http)

    async def put_budget(http: Request) -> Response:
        check(http)
        try:
            config = BudgetConfig.model_validate_json(await http.body())
            key, value = budget_record(config, settings.budget_tz)
        except (ValidationError, ValueError) as exc:
            raise invalid_request(f"not a budget: {exc}", None) from None
        await publish(settings, key, value)
        return JSONResponse({"budget_id": key.decode(), "budget": config.model_dump(mode="json")})

    async def delete_budget(http: Request) -> Response:
        check(http)
        budget_id = http.path_params["budget_id"]
        try:
            parse_budget_id(budget_id)
        except ValueError as exc:
            raise invalid_request(str(exc), None) from None
        await publish(settings, budget_id.encode(), None)
        return JSONResponse({"budget_id": budget_id, "deleted": True})

    async def show_budgets(http: Request) -> Response:
        check(http)
        try:
            return JSONResponse(await asyncio.to_thread(job_budgets, settings))
        except (OSError, RuntimeError) as exc:
            raise ApiError(503, f"the job's budgets: {exc}", type="server_error") from None

    return [
        Route("/admin/budgets", put_budget, methods=["PUT"]),
        Route("/admin/budgets", show_budgets, methods=["GET"]),
        Route("/admin/budgets/{budget_id:path}", delete_budget, methods=["DELETE"]),
    ]
