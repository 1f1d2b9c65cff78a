"""Data on the bus: pydantic models and their (de)serialization. Imports nothing else."""

from schemas.codec import SchemaError, decode, encode
from schemas.messages import (
    REASSIGNED,
    SCHEMA_VERSION,
    CancelRequest,
    ChatMessage,
    DeadLetter,
    ErrorInfo,
    FinishReason,
    InferenceRequest,
    SamplingParams,
    TokenChunk,
    TokenChunkBatch,
    UsageEvent,
    UsageStatus,
    WorkerStatus,
)

__all__ = [
    "REASSIGNED",
    "SCHEMA_VERSION",
    "CancelRequest",
    "ChatMessage",
    "DeadLetter",
    "ErrorInfo",
    "FinishReason",
    "InferenceRequest",
    "SamplingParams",
    "SchemaError",
    "TokenChunk",
    "TokenChunkBatch",
    "UsageEvent",
    "UsageStatus",
    "WorkerStatus",
    "decode",
    "encode",
]
