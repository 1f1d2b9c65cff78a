"""Writes one JSON Schema file per bus message, for producers in other languages.

A ``TokenChunk`` is never a record of its own: it travels inside a ``TokenChunkBatch``,
whose schema defines it.

python -m schemas.export          # rewrite schemas/json/*.schema.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
from pydantic import BaseModel

from schemas.fleet import LoadReport, WorkerStatus
from schemas.messages import CancelRequest, DeadLetter, InferenceRequest
from schemas.replies import TokenChunkBatch
from schemas.usage import UsageEvent

BUS_MESSAGES: tuple[type[BaseModel], ...] = (
    InferenceRequest,
    TokenChunkBatch,
    UsageEvent,
    WorkerStatus,
    CancelRequest,
    DeadLetter,
    LoadReport,
)
SCHEMA_DIR = Path(__file__).parent / "json"


def render(model: type[BaseModel]) -> bytes:
    schema = model.model_json_schema(mode="validation")
    schema["$id"] = f"https://tokenbus.dev/schemas/{model.__name__}.schema.json"
    return orjson.dumps(schema, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def schema_path(model: type[BaseModel]) -> Path:
    return SCHEMA_DIR / f"{model.__name__}.schema.json"


def main() -> int:
    SCHEMA_DIR.mkdir(exist_ok=True)
    for model in BUS_MESSAGES:
        schema_path(model).write_bytes(render(model))
        print(f"wrote {schema_path(model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
