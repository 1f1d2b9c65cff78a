"""The whole bridge app (``create_app``) with no Kafka behind it: what every route shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from bridge.app import create_app
from tokenbus.config import Settings
from tokenbus.tenants import hash_api_key

KEY = "sk-alice-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


class NoBus:
    """Never called by the routes these tests use."""

    reply_topic = "tokenbus.replies.bridge-test"
    reply_prefix = "tokenbus.replies.bridge-test"


@pytest.fixture
def app(tmp_path: Path) -> Starlette:
    return build(tmp_path)


def build(tmp_path: Path, **overrides: Any) -> Starlette:
    tenants = {"alice": {"api_key_sha256": [hash_api_key(KEY)], "models": ["tiny-llama"]}}
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(json.dumps({"tenants": tenants}))
    settings = Settings(
        home=tmp_path,
        tenants_file=tenants_file,
        model_path=tmp_path / "no-model",
        bus_service_secret="unit-test-bus-service-secret-0123456789",
        **overrides,
    )
    bus: Any = NoBus()
    return create_app(settings, bus=bus)


def assert_openai_error(answer: Any, status: int, code: str | None) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["x-request-id"].startswith("req_")
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == code
    return dict(error)


def test_starlette_s_own_refusals_answer_in_openai_s_error_shape(app: Starlette) -> None:
    client = TestClient(app)

    unknown = client.post("/v1/embeddings", headers=AUTH, json={})
    error = assert_openai_error(unknown, 404, "not_found")
    assert error["message"] == "Invalid URL (POST /v1/embeddings)."

    wrong_method = client.get("/v1/chat/completions", headers=AUTH)
    assert_openai_error(wrong_method, 405, "method_not_allowed")
    assert wrong_method.headers["allow"] == "POST"

    nameless_part = client.post(
        "/v1/files",
        headers={**AUTH, "Content-Type": "multipart/form-data; boundary=XX"},
        content=b"--XX\r\nContent-Disposition: form-data\r\n\r\nv\r\n--XX--\r\n",
    )
    error = assert_openai_error(nameless_part, 400, "invalid_body")
    assert "name" in error["message"]


def test_metrics_are_the_operator_s_not_a_caller_s(tmp_path: Path) -> None:
    # They name every tenant and the models it used, its adapters included.
    client = TestClient(build(tmp_path, admin_key="adm-0123456789"))
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=AUTH).status_code == 401
    scraped = client.get("/metrics", headers={"Authorization": "Bearer adm-0123456789"})
    assert scraped.status_code == 200
    assert "tokenbus_bridge_requests_total" in scraped.text

    no_admin_key = TestClient(build(tmp_path))
    assert no_admin_key.get("/metrics", headers=AUTH).status_code == 404


class RecordTooLarge(NoBus):
    """A bus whose producer refuses the request's record, as aiokafka does past its
    ``max_request_size``."""

    async def submit(self, **fields: Any) -> Any:
        from aiokafka.errors import MessageSizeTooLargeError

        raise MessageSizeTooLargeError("the record is larger than max_request_size")


def test_a_request_too_large_for_a_record_is_a_413_not_a_500(tmp_path: Path) -> None:
    bus: Any = RecordTooLarge()
    tenants = {"alice": {"api_key_sha256": [hash_api_key(KEY)], "models": ["tiny-llama"]}}
    (tmp_path / "tenants.json").write_text(json.dumps({"tenants": tenants}))
    settings = Settings(
        home=tmp_path,
        tenants_file=tmp_path / "tenants.json",
        model_path=tmp_path / "no-model",
        bus_service_secret="unit-test-bus-service-secret-0123456789",
    )
    client = TestClient(create_app(settings, bus=bus))
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    answer = client.post("/v1/chat/completions", headers=AUTH, json=body)
    error = assert_openai_error(answer, 413, "request_too_large")
    assert "larger than a bus record" in error["message"]
