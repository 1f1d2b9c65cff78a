"""The bridge's OpenAPI 3.1 document, generated from the models in ``schemas.openai_api``.

Every operation lists every status it can answer, with OpenAI's error body, the
``X-Session-ID``/``X-Request-ID`` headers every response carries, and the rate-limit
headers of a 429. schemathesis tests the running bridge against this document.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from schemas.openai_api import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelList,
)

REF = "#/components/schemas/{model}"
_ID_HEADERS = {
    "X-Session-ID": {
        "description": "The session this request was billed to: the caller's own, or new.",
        "required": True,
        "schema": {"type": "string", "pattern": "^sess_[0-9A-HJKMNP-TV-Z]{26}$"},
    },
    "X-Request-ID": {
        "description": "This request's ID.",
        "required": True,
        "schema": {"type": "string", "pattern": "^req_[0-9A-HJKMNP-TV-Z]{26}$"},
    },
}
_RATE_HEADERS = {
    "Retry-After": {"required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"}},
}
_ERRORS = {
    "400": "Invalid body or parameter; `error.param` names the field.",
    "401": "Missing or invalid API key or token.",
    "403": "The tenant may not use this model.",
    "404": "No such model: neither configured nor served now (`model_not_found`).",
    "408": "The body did not arrive within the read timeout; the connection is closed.",
    "413": "The body or the prompt is too long for the tenant.",
    "429": "Over the per-key rate or the tenant's quota; see Retry-After.",
    "503": "No worker serves the model now, or the fleet sheds load.",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _error(description: str, status: str) -> dict[str, Any]:
    headers = {**_ID_HEADERS, **(_RATE_HEADERS if status == "429" else {})}
    return {
        "description": description,
        "headers": headers,
        "content": {"application/json": {"schema": _ref(ErrorResponse)}},
    }


def _errors(*statuses: str) -> dict[str, Any]:
    return {status: _error(_ERRORS[status], status) for status in statuses}


def _event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One SSE event: its data is a JSON chunk, a JSON error (after streaming began),
    or the final ``[DONE]``. Heartbeat comments are not events."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
                    },
                ]
            },
        },
    }


def _completion_operation(
    summary: str, request: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel]
) -> dict[str, Any]:
    return {
        "summary": summary,
        "security": [{"bearer": []}],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {
                "description": "The completion; with `stream: true`, Server-Sent Events "
                "of chunks ending with `data: [DONE]`.",
                "headers": _ID_HEADERS,
                "content": {
                    "application/json": {"schema": _ref(response)},
                    "text/event-stream": {"schema": _event_schema(chunk)},
                },
            },
            **_errors("400", "401", "403", "404", "408", "413", "429", "503"),
        },
    }


def build_spec(model_example: str = "tiny-llama") -> dict[str, Any]:
    _, schemas = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (CompletionRequest, "validation"),
            (ChatCompletion, "serialization"),
            (ChatCompletionChunk, "serialization"),
            (Completion, "serialization"),
            (ModelList, "serialization"),
            (ErrorResponse, "serialization"),
            (Health, "serialization"),
        ],
        ref_template=REF,
    )
    components = schemas["$defs"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        components[name]["properties"]["model"]["examples"] = [model_example]
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenbus bridge", "version": "1.0.0"},
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": {
            "/v1/chat/completions": {
                "post": _completion_operation(
                    "Chat completion", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk
                )
            },
            "/v1/completions": {
                "post": _completion_operation(
                    "Text completion", CompletionRequest, Completion, Completion
                )
            },
            "/v1/models": {
                "get": {
                    "summary": "Models the caller's tenant may use that the fleet serves",
                    "security": [{"bearer": []}],
                    "responses": {
                        "200": {
                            "description": "The models.",
                            "headers": _ID_HEADERS,
                            "content": {"application/json": {"schema": _ref(ModelList)}},
                        },
                        **_errors("401", "429"),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Liveness",
                    "responses": {
                        "200": {
                            "description": "Serving.",
                            "headers": _ID_HEADERS,
                            "content": {"application/json": {"schema": _ref(Health)}},
                        }
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics, for the operator: the admin key as bearer",
                    "security": [{"bearer": []}],
                    "responses": {
                        "200": {
                            "description": "Prometheus text format.",
                            "headers": _ID_HEADERS,
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        "401": _error("Any credential but the admin key.", "401"),
                        "404": _error("No admin key is configured.", "404"),
                    },
                }
            },
        },
    }
