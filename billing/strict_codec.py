"""A record read strictly with msgspec first, and by its public pydantic schema otherwise.

The sinks' fast readings (``usage_codec``, ``span_codec``) mirror a schema field for
field with strict JSON and strict types, so whatever they accept the schema accepts too,
with the same values. What they refuse goes through ``schemas.decode``, which either
accepts it (pydantic's lax mode) or names the reason for the dead-letter topic.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from pydantic import BaseModel

from schemas import decode

Fast = TypeVar("Fast")
Model = TypeVar("Model", bound=BaseModel)


def decode_strict_first(
    decoder: msgspec.json.Decoder[Fast], model: type[Model], raw: bytes | None
) -> Fast | Model:
    """``raw`` by ``decoder``; if it refuses, by ``model`` (raising ``SchemaError`` with
    the reason when that refuses too)."""
    if raw is not None:
        try:
            return decoder.decode(raw)
        except msgspec.MsgspecError:
            pass  # refused by the strict reading: pydantic decides, and says why
    return decode(model, raw)
