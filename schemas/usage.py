"""What billing reads: one ``UsageEvent`` per request attempt."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import Field

from schemas.messages import Message, Priority, utc_now
from schemas.replies import FinishReason


class UsageStatus(StrEnum):
    OK = "ok"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    FAILED = "failed"


class UsageEvent(Message):
    """Exactly one per request attempt, produced to ``usage`` keyed by tenant."""

    request_id: str
    session_id: str
    tenant_id: str
    model: str
    worker_id: str | None = None
    priority: Priority = 1
    attempt: int = 0
    status: UsageStatus
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    error_code: str | None = None
    overload_tier: Annotated[int, Field(ge=0, le=2)] = 0
    precision: str = "fp16"
    """Weights precision (fp32, fp16, bf16, int8), for the cost weights."""
    flags: list[str] = Field(default_factory=list)
    key_sha256: str | None = None
    """The credential's hash the job charged key budgets to (``WorkItem.key_sha256``)."""
    created_at: datetime
    """When the job admitted the request: what prices and peak hours go by."""
    finished_at: datetime = Field(default_factory=utc_now)
    last_seq: int | None = None
    """The ``seq`` of the request's last chunk, so a duplicate's answer continues it."""
    adapter: str | None = None
    """The LoRA adapter that served it (``model`` is the base model); None: the base."""
    batch_id: str | None = None
    """The batch job the request was a line of (``WorkItem.batch_id``)."""
