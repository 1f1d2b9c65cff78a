"""What a reply topic carries: a request's output in chunks, batched per tenant, and
how a request ended (``finish_reason``, ``ErrorInfo``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.messages import Message


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REJECTED = "rejected"


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str
    """Machine-readable: ``quota_exceeded``, ``no_worker``, ``engine_error``, ..."""
    message: str
    retry_after_s: float | None = None
    limit_kind: Literal["tokens", "requests"] | None = None
    """On ``quota_exceeded``: the per-minute limit that refused the request."""
    num_limit: int | None = None
    """That limit, per minute."""
    num_remaining: int | None = None
    """What the window has left of it (tokens may be left, just fewer than needed)."""


class TokenChunk(Message):
    """A slice of one request's output, sent to the request's ``reply_to`` topic inside
    a ``TokenChunkBatch`` (never as a record of its own)."""

    request_id: str
    tenant_id: str
    seq: Annotated[int, Field(ge=0)]
    """0, 1, 2, ... per request: a gap or a repeat is visible to the client."""
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    num_tokens: Annotated[int, Field(ge=0)] = 0
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    num_prompt_tokens: Annotated[int, Field(ge=0)] | None = None
    """On the last chunk from a worker: the prompt's length as the engine counted it."""

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


class TokenChunkBatch(Message):
    """The one kind of record on a reply topic, keyed by tenant: chunks of one tenant.

    A worker sends one per engine step per (reply topic, tenant); a single chunk is a
    batch of one. Chunks of one request appear in ``seq`` order, within a batch and
    across the topic's batches.
    """

    tenant_id: str
    chunks: Annotated[list[TokenChunk], Field(min_length=1)]

    @model_validator(mode="after")
    def _one_tenant(self) -> TokenChunkBatch:
        if any(chunk.tenant_id != self.tenant_id for chunk in self.chunks):
            raise ValueError("every chunk must belong to the batch's tenant_id")
        return self
