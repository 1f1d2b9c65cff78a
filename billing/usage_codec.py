"""Usage record bytes --> ``UsageRecord``, validated in one msgspec pass; pydantic for the rest.

The sink decodes every usage record, and ``schemas.decode`` (orjson, then pydantic) was
a fifth of its CPU. ``decode_usage`` tries a msgspec Struct with the fields, defaults
and limits of ``schemas.UsageEvent`` first: strict JSON and strict types, so whatever
it accepts, ``schemas.decode`` accepts too, with the same values (the unit tests hold
the two together). Whatever it refuses, including what pydantic's lax mode would
coerce (``"5"`` for 5, a Unix timestamp for a datetime), goes through
``schemas.decode``, which either accepts it or names the reason for the dead-letter
topic. One difference is left: a timestamp with more than six decimals of a second is
rounded to the microsecond here and cut there; producers write microseconds at most.
``UsageEvent`` stays the public schema; this is its reading on the sink's path.

The strict reading also refuses the counts that no row can hold, negative or past the
UInt32 columns (``billing.rows.check_storable``): such a record goes through
``schemas.decode`` and is dead-lettered with that check's reason, so every
``UsageRecord`` is storable.
``decode_usages`` reads a whole fetch that way in one call, without a Python frame per
record; the sink takes the record-by-record path only for a fetch it refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec

from billing.strict_codec import decode_strict_first
from schemas import SCHEMA_VERSION, FinishReason, UsageEvent, UsageStatus

_Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""Within what orjson reads as an integer (``schemas.decode`` refuses larger ones)."""
MAX_COUNT = 2**32 - 1
"""The largest attempt or token count a row holds: those columns are UInt32."""
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
"""A count a row holds (a UInt32 column): one out of range takes the pydantic path."""
_Tier = Annotated[int, msgspec.Meta(ge=0, le=2)]


def _now() -> datetime:
    return datetime.now(UTC)


class UsageRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``schemas.UsageEvent``, field for field."""

    request_id: str
    session_id: str
    tenant_id: str
    model: str
    status: UsageStatus
    created_at: datetime
    schema_version: Literal[1] = SCHEMA_VERSION
    worker_id: str | None = None
    priority: _Tier = 1
    attempt: _Count = 0
    finish_reason: FinishReason | None = None
    num_prompt_tokens: _Count = 0
    num_completion_tokens: _Count = 0
    num_cached_tokens: _Count = 0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    error_code: str | None = None
    overload_tier: _Tier = 0
    precision: str = "fp16"
    flags: list[str] = msgspec.field(default_factory=list)
    key_sha256: str | None = None
    finished_at: datetime = msgspec.field(default_factory=_now)
    last_seq: _Int | None = None
    adapter: str | None = None
    batch_id: str | None = None


Usage = UsageEvent | UsageRecord
"""What billing reads an attempt from: the public model, or its fast reading."""

_DECODER = msgspec.json.Decoder(UsageRecord)


def decode_usage(raw: bytes | None) -> Usage:
    """One usage record; raises ``schemas.SchemaError`` with the reason if it is not one."""
    return decode_strict_first(_DECODER, UsageEvent, raw)


def decode_usages(raws: Sequence[bytes | None]) -> list[UsageRecord] | None:
    """Every record of ``raws`` read strictly, in order; None if the strict reading
    refuses any of them (then ``decode_usage`` reads each one and names the reasons)."""
    try:
        return list(map(_DECODER.decode, raws))  # type: ignore[arg-type]
    except (msgspec.MsgspecError, TypeError):  # TypeError: a tombstone (None)
        return None
