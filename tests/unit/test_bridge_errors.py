from __future__ import annotations

import pytest

from bridge.errors import model_not_allowed, rate_limit_headers, rejection
from schemas import ErrorInfo


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("quota_exceeded", 429),
        ("no_worker", 503),
        ("overloaded", 503),
        ("model_not_allowed", 403),
        ("prompt_too_long", 413),
        ("request_too_large", 413),
        ("invalid_request", 400),
        ("timeout", 504),
        ("engine_error", 502),
    ],
)
def test_bus_errors_map_to_http_statuses(code: str, status: int) -> None:
    error = rejection(ErrorInfo(code=code, message="m", retry_after_s=2.5), tokens_per_minute=900)
    assert error.status == status
    assert error.body()["error"]["message"] == "m"


def test_a_job_s_model_refusal_answers_as_the_bridge_s_own() -> None:
    by_job = rejection(ErrorInfo(code="model_not_allowed", message="m"), tokens_per_minute=900)
    by_bridge = model_not_allowed("tiny")

    assert by_job.body()["error"] == {
        "message": "m",
        "type": "permission_error",
        "param": "model",
        "code": "model_not_allowed",
    }
    assert (by_job.status, by_job.type, by_job.code, by_job.param) == (
        by_bridge.status,
        by_bridge.type,
        by_bridge.code,
        by_bridge.param,
    )
    assert by_bridge.message == "Your tenant may not use the model 'tiny'."


def test_quota_rejection_carries_retry_after_and_token_headers() -> None:
    error = rejection(
        ErrorInfo(code="quota_exceeded", message="m", retry_after_s=2.2), tokens_per_minute=900
    )
    assert error.headers["Retry-After"] == "3"  # whole seconds, rounded up
    assert error.headers["x-ratelimit-limit-tokens"] == "900"
    assert error.headers["x-ratelimit-remaining-tokens"] == "0"
    assert error.headers["x-ratelimit-reset-tokens"] == "2.200s"


def test_quota_rejection_names_the_limit_that_refused() -> None:
    by_requests = ErrorInfo(
        code="quota_exceeded",
        message="m",
        retry_after_s=41.25,
        limit_kind="requests",
        num_limit=3,
        num_remaining=0,
    )
    headers = rejection(by_requests, tokens_per_minute=900).headers
    assert headers == {
        "Retry-After": "42",
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "41.250s",
    }
    by_tokens = by_requests.model_copy(
        update={"limit_kind": "tokens", "num_limit": 120, "num_remaining": 20}
    )
    headers = rejection(by_tokens, tokens_per_minute=900).headers
    assert headers["x-ratelimit-limit-tokens"] == "120"  # the job's limit, not the bridge's
    assert headers["x-ratelimit-remaining-tokens"] == "20"


def test_retry_after_is_at_least_one_second() -> None:
    assert (
        rate_limit_headers(kind="requests", limit=5, remaining=0, reset_s=0.01)["Retry-After"]
        == "1"
    )


def test_a_spent_budget_is_openai_s_insufficient_quota() -> None:
    error = rejection(
        ErrorInfo(code="insufficient_quota", message="budget spent", retry_after_s=3600.5),
        tokens_per_minute=100,
    )
    assert (error.status, error.type, error.code) == (
        429,
        "insufficient_quota",
        "insufficient_quota",
    )
    assert error.body()["error"]["message"] == "budget spent"
    assert error.headers == {"Retry-After": "3601"}
