"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Each failure the bridge can answer is one factory here, so every handler answers the
same status, type and code for the same cause. ``rejection`` maps the job's and the
workers' error chunks (quota, no worker, engine) onto the same shapes.
"""

from __future__ import annotations

import math
from typing import Any

from schemas import ErrorInfo
from tokenbus.chunks import ChunkError


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_request(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, type="invalid_request_error", code=code, param=param)


def unauthorized(message: str = "Invalid API key or token.") -> ApiError:
    return ApiError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def model_not_allowed(model: str) -> ApiError:
    return model_refused(f"Your tenant may not use the model {model!r}.")


def model_refused(message: str) -> ApiError:
    """A model the tenant may not use, in the words of whoever refused it."""
    return ApiError(403, message, type="permission_error", code="model_not_allowed", param="model")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        type="invalid_request_error",
        code="model_not_found",
        param="model",
    )


def request_timeout(timeout_s: float) -> ApiError:
    # The rest of the body may still come: the connection cannot carry another request.
    return ApiError(
        408,
        f"The request body did not arrive within {timeout_s:g} s.",
        type="invalid_request_error",
        code="request_timeout",
        headers={"Connection": "close"},
    )


def too_large(message: str, param: str | None, code: str) -> ApiError:
    return ApiError(413, message, type="invalid_request_error", code=code, param=param)


def rate_limit_headers(
    *, kind: str, limit: float, remaining: float, reset_s: float
) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up) and OpenAI's ``x-ratelimit-*`` set."""
    return {
        **retry_after(reset_s),
        f"x-ratelimit-limit-{kind}": str(int(limit)),
        f"x-ratelimit-remaining-{kind}": str(max(0, int(remaining))),
        f"x-ratelimit-reset-{kind}": f"{max(0.0, reset_s):.3f}s",
    }


def retry_after(seconds: float | None) -> dict[str, str]:
    """``Retry-After`` in whole seconds, rounded up, at least 1; none for no wait known."""
    return {} if seconds is None else {"Retry-After": str(max(1, math.ceil(seconds)))}


def rate_limited(message: str, code: str, headers: dict[str, str]) -> ApiError:
    return ApiError(429, message, type="rate_limit_error", code=code, headers=headers)


def rejection(error: ErrorInfo | ChunkError, *, tokens_per_minute: int) -> ApiError:
    """The bus's refusal or failure of a request, as an HTTP error."""
    if error.code == "quota_exceeded":
        retry = error.retry_after_s if error.retry_after_s is not None else 60.0
        if error.limit_kind is not None and error.num_limit is not None:
            headers = rate_limit_headers(
                kind=error.limit_kind,
                limit=error.num_limit,
                remaining=error.num_remaining or 0,
                reset_s=retry,
            )
        else:  # a job that does not say which limit refused: the tenant's tokens
            headers = rate_limit_headers(
                kind="tokens", limit=tokens_per_minute, remaining=0, reset_s=retry
            )
        return rate_limited(error.message, "quota_exceeded", headers)
    if error.code == "insufficient_quota":
        # OpenAI's answer to a spent budget: 429 with this code, and no Retry-After
        # unless the budget says when its period turns.
        headers = retry_after(error.retry_after_s)
        return ApiError(
            429, error.message, type="insufficient_quota", code=error.code, headers=headers
        )
    if error.code == "model_not_allowed":
        return model_refused(error.message)
    if error.code == "prompt_too_long":
        return too_large(error.message, None, "context_length_exceeded")
    if error.code == "request_too_large":
        return too_large(error.message, None, "request_too_large")
    if error.code == "invalid_request":
        return invalid_request(error.message, None)
    if error.code in ("no_worker", "overloaded"):
        headers = retry_after(error.retry_after_s)
        return ApiError(503, error.message, type="server_error", code=error.code, headers=headers)
    if error.code == "timeout":
        return ApiError(504, error.message, type="server_error", code="timeout")
    return ApiError(502, error.message, type="server_error", code=error.code)
