from __future__ import annotations

from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient

from bridge.admin import admin_routes
from bridge.errors import ApiError
from tokenbus.config import Settings


def client_for(settings: Settings, sent: list[tuple[bytes, bytes | None]]) -> TestClient:
    async def publish(settings: Settings, key: bytes, value: bytes | None) -> None:
        sent.append((key, value))

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), exc.status)

    app = Starlette(
        routes=admin_routes(settings, publish), exception_handlers={ApiError: api_error}
    )
    return TestClient(app)


def test_only_the_admin_key_sets_and_removes_budgets(tmp_path: Path) -> None:
    sent: list[tuple[bytes, bytes | None]] = []
    client = client_for(Settings(home=tmp_path, admin_key="adm-123"), sent)
    body = {"tenant": "acme", "limit": "500", "period": "month"}
    assert client.put("/admin/budgets", json=body).status_code == 401
    assert (
        client.put(
            "/admin/budgets", json=body, headers={"Authorization": "Bearer sk-acme"}
        ).status_code
        == 401
    )
    admin = {"Authorization": "Bearer adm-123"}
    answer = client.put("/admin/budgets", json=body, headers=admin)
    assert answer.status_code == 200 and answer.json()["budget_id"] == "tenant:acme|month@UTC"
    assert client.put("/admin/budgets", json={"limit": "1"}, headers=admin).status_code == 400
    gone = client.delete("/admin/budgets/tenant:acme|month@UTC", headers=admin)
    assert gone.status_code == 200
    assert [k for k, _ in sent] == [b"tenant:acme|month@UTC"] * 2 and sent[1][1] is None


def test_no_admin_key_no_admin_api(tmp_path: Path) -> None:
    client = client_for(Settings(home=tmp_path), [])
    assert client.get("/admin/budgets", headers={"Authorization": "Bearer x"}).status_code == 404


@pytest.mark.parametrize(
    "fields",
    [
        {"tenant": "a|b"},  # the id joins its parts with "|": undeletable, unparseable
        {"tenant": "a\tb"},  # the job's spend keys join theirs with a tab
        {"tenant": "acme", "model": "m|x"},
        {"tenant": "acme", "model": "m@UTC"},
        {"model": "m\tx"},
        {"model": "m\nx"},
    ],
)
def test_a_budget_whose_names_would_break_its_id_or_keys_is_a_400(
    tmp_path: Path, fields: dict[str, str]
) -> None:
    sent: list[tuple[bytes, bytes | None]] = []
    client = client_for(Settings(home=tmp_path, admin_key="adm"), sent)
    answer = client.put(
        "/admin/budgets", json={"limit": "5", **fields}, headers={"Authorization": "Bearer adm"}
    )
    assert answer.status_code == 400, answer.text
    assert sent == []
