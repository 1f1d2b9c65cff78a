"""The reply topics' codec: ``TokenChunkBatch`` records <-> plain structs, in one pass.

# engine delta --> Chunk --> encode_batch --> one record per (reply topic, tenant, step)
# record value --> decode_batch (JSON, types, required fields, one tenant) --> ChunkBatch

Every token crosses this codec twice (worker, then client or bridge), so it uses
``msgspec`` structs rather than the pydantic models: decoding and checking a batch is
one C pass, several times cheaper than ``model_validate``. The structs are not tracked by
the cyclic garbage collector (``gc=False``: they hold no cycles), so the many a reader
makes per second neither count towards a collection nor lengthen one. The structs mirror
``schemas.TokenChunk``, ``schemas.ErrorInfo`` and ``schemas.TokenChunkBatch`` field for
field (the published JSON Schema stays the pydantic one; a unit test holds the two
equal), and the checks are the schema's: strict types (no ``"3"`` for ``3``, no
``true`` for ``1``), required fields, no unknown fields, ``schema_version`` 1, at least
one chunk, and every chunk of the batch's tenant. A failure is a ``SchemaError`` whose
message is the reason the consumer puts on the dead-letter topic.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from schemas import SCHEMA_VERSION, FinishReason, SchemaError, TokenChunk

INT64_MAX = 2**63 - 1
Int = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
"""JSON integers as the models' orjson decoding reads them: 64 bits at most."""
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]


class ChunkError(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, gc=False
):
    """``schemas.ErrorInfo`` on a chunk: why a request was refused or failed."""

    code: str
    message: str
    retry_after_s: float | None = None
    limit_kind: Literal["tokens", "requests"] | None = None
    num_limit: Int | None = None
    num_remaining: Int | None = None


class Chunk(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    """``schemas.TokenChunk``: a slice of one request's output."""

    request_id: str
    tenant_id: str
    seq: NonNegative
    text: str = ""
    token_ids: list[Int] = []
    num_tokens: NonNegative = 0
    finish_reason: FinishReason | None = None
    error: ChunkError | None = None
    num_prompt_tokens: NonNegative | None = None
    schema_version: Literal[1] = SCHEMA_VERSION

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


class ChunkBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, gc=False):
    """``schemas.TokenChunkBatch``: the one kind of record on a reply topic."""

    schema_version: Literal[1] = SCHEMA_VERSION
    tenant_id: str
    chunks: Annotated[list[Chunk], msgspec.Meta(min_length=1)]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ChunkBatch)


def encode_batch(tenant_id: str, chunks: list[Chunk]) -> bytes:
    """One reply record's value. The worker builds every chunk itself, for this tenant."""
    return _encoder.encode(ChunkBatch(tenant_id=tenant_id, chunks=chunks))


def decode_batch(raw: bytes | None) -> ChunkBatch:
    """A reply record's value, checked; ``SchemaError`` names what is wrong."""
    if raw is None:
        raise SchemaError("empty message (tombstone)")
    try:
        batch = _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise SchemaError(_reason(str(exc), raw)) from None
    except msgspec.DecodeError as exc:
        raise SchemaError(f"not JSON: {exc}") from None
    tenant_id = batch.tenant_id
    for i, chunk in enumerate(batch.chunks):
        if chunk.tenant_id != tenant_id:
            raise SchemaError(
                f"invalid TokenChunkBatch: chunks[{i}] is of tenant {chunk.tenant_id!r}, "
                f"the batch of tenant {tenant_id!r}: every chunk must belong to the "
                "batch's tenant_id"
            )
    return batch


def _reason(problem: str, raw: bytes) -> str:
    if problem.startswith("Expected `object`") and " - at `" not in problem:
        return f"expected a JSON object: {problem}"
    if problem.endswith("at `$.schema_version`"):
        version = _version_of(raw)
        return (
            f"unknown schema_version {version!r} for TokenChunkBatch "
            f"(this consumer knows {SCHEMA_VERSION})"
        )
    return f"invalid TokenChunkBatch: {problem}"


def _version_of(raw: bytes) -> Any:
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return data.get("schema_version") if isinstance(data, dict) else None


def to_model(chunk: Chunk) -> TokenChunk:
    """The pydantic model of ``chunk``, for code off the hot path (tools, tests)."""
    return TokenChunk.model_validate(msgspec.to_builtins(chunk))


def from_model(chunk: TokenChunk) -> Chunk:
    """The struct of a pydantic ``TokenChunk`` (the job builds its refusals so)."""
    return msgspec.convert(chunk.model_dump(mode="json", exclude_none=True), Chunk)
