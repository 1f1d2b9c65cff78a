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
    "UsageEvent",
    "UsageStatus",
    "WorkerStatus",
    "decode",
    "encode",
]
