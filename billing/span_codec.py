"""Span batch bytes --> ``SpanBatchRecord``, validated in one msgspec pass; pydantic for the rest.

The span sink decodes every batch every service sends, and ``schemas.decode`` (orjson,
then pydantic with a pattern per id) was most of its CPU per span. ``decode_spans``
tries msgspec Structs with the fields, defaults and limits of ``schemas.spans`` first:
strict JSON and strict types, so whatever they accept, ``schemas.decode`` accepts too,
with the same values (the unit tests hold the two together). Whatever they refuse goes
through ``schemas.decode``, which either accepts it or names the reason for the
dead-letter topic. ``SpanBatch`` stays the public schema; this is its reading on the
sink's path.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from billing.strict_codec import decode_strict_first
from schemas import SCHEMA_VERSION, decode
from schemas.spans import SpanBatch

# Lengths here; that every character is a lowercase hex digit is checked once per batch
# (``_ids_are_hex``): a pattern per id was most of the decode's CPU.
_TraceId = Annotated[str, msgspec.Meta(min_length=32, max_length=32)]
_SpanId = Annotated[str, msgspec.Meta(min_length=16, max_length=16)]
_Ns = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class SpanRecordFast(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``schemas.spans.SpanRecord``, field for field."""

    trace_id: _TraceId
    span_id: _SpanId
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    service: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    start_ns: _Ns
    end_ns: _Ns
    parent_span_id: _SpanId | None = None
    status: Literal["unset", "ok", "error"] = "unset"
    attributes: dict[str, str | bool | int | float] = msgspec.field(default_factory=dict)


class SpanBatchRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``schemas.spans.SpanBatch``, field for field."""

    tenant_id: str
    spans: Annotated[list[SpanRecordFast], msgspec.Meta(min_length=1)]
    schema_version: Literal[1] = SCHEMA_VERSION


Spans = SpanBatch | SpanBatchRecord
"""What the sink reads a batch as: the public model, or its fast reading."""

_DECODER = msgspec.json.Decoder(SpanBatchRecord)


_HEX = re.compile("[0-9a-f]*")


def decode_spans(raw: bytes | None) -> Spans:
    """One span batch; raises ``schemas.SchemaError`` with the reason if it is not one."""
    batch = decode_strict_first(_DECODER, SpanBatch, raw)
    if isinstance(batch, SpanBatchRecord) and not _ids_are_hex(batch):
        return decode(SpanBatch, raw)  # refuses it, naming the id
    return batch


def _ids_are_hex(batch: SpanBatchRecord) -> bool:
    """Every id of the batch lowercase hex: its lengths are the decoder's to check, so one
    match over them all is a pattern per id."""
    ids = "".join([s.trace_id + s.span_id + (s.parent_span_id or "") for s in batch.spans])
    return _HEX.fullmatch(ids) is not None
