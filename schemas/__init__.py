"""Data on the bus: pydantic models and their (de)serialization. Imports nothing else.

``openai_api`` holds OpenAI's HTTP bodies, which the bridge speaks and batch output lines
are written in."""

from schemas.codec import SchemaError, decode, encode
from schemas.fleet import LoadReport, WorkerStatus
from schemas.messages import (
    INTERNAL_FIELDS,
    REASSIGNED,
    REQUEST_ID_PATTERN,
    SCHEMA_VERSION,
    TENANT_ID_PATTERN,
    Adapter,
    CancelRequest,
    ChatMessage,
    DeadLetter,
    InferenceRequest,
    SamplingParams,
    WorkItem,
)
from schemas.replies import ErrorInfo, FinishReason, TokenChunk, TokenChunkBatch
from schemas.usage import UsageEvent, UsageStatus

__all__ = [
    "INTERNAL_FIELDS",
    "REASSIGNED",
    "REQUEST_ID_PATTERN",
    "SCHEMA_VERSION",
    "TENANT_ID_PATTERN",
    "Adapter",
    "CancelRequest",
    "ChatMessage",
    "DeadLetter",
    "ErrorInfo",
    "FinishReason",
    "InferenceRequest",
    "LoadReport",
    "SamplingParams",
    "SchemaError",
    "TokenChunk",
    "TokenChunkBatch",
    "UsageEvent",
    "UsageStatus",
    "WorkItem",
    "WorkerStatus",
    "decode",
    "encode",
]
