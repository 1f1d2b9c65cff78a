"""Bytes <-> messages, with orjson. A failure names its reason for the dead-letter topic."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from schemas.messages import SCHEMA_VERSION

M = TypeVar("M", bound=BaseModel)


class SchemaError(ValueError):
    """A message that cannot be decoded: bad JSON, unknown version, or invalid fields."""


def encode(message: BaseModel) -> bytes:
    return orjson.dumps(message.model_dump(mode="python", exclude_none=True))


def decode(model: type[M], raw: bytes | None) -> M:
    if raw is None:
        raise SchemaError("empty message (tombstone)")
    try:
        data: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SchemaError(f"expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise SchemaError(
            f"unknown schema_version {version!r} for {model.__name__} "
            f"(this consumer knows {SCHEMA_VERSION})"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        raise SchemaError(f"invalid {model.__name__}: {problems}") from None
