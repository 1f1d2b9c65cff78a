"""The span sink's strict reading of span batches agrees with ``schemas.decode``."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from billing.span_codec import SpanBatchRecord, SpanRecordFast, decode_spans
from schemas import SchemaError, decode
from schemas.spans import SpanBatch, SpanRecord

_SPAN = {
    "trace_id": "a" * 32,
    "span_id": "b" * 16,
    "name": "job.admit",
    "service": "tokenbus-job",
    "start_ns": 1_767_000_000_000_000_000,
    "end_ns": 1_767_000_000_000_500_000,
}


def _raw(*spans: dict[str, object], **fields: object) -> bytes:
    return orjson.dumps({"schema_version": 1, "tenant_id": "acme", "spans": spans, **fields})


def _values(batch: object) -> tuple[object, list[dict[str, object]]]:
    spans = [{n: getattr(s, n) for n in SpanRecord.model_fields} for s in batch.spans]  # type: ignore[attr-defined]
    return batch.tenant_id, spans  # type: ignore[attr-defined]


def test_the_records_have_the_models_fields() -> None:
    assert set(SpanRecordFast.__struct_fields__) == set(SpanRecord.model_fields)
    assert set(SpanBatchRecord.__struct_fields__) == set(SpanBatch.model_fields)


ACCEPTED_BY_BOTH = [
    _raw(_SPAN),
    _raw({**_SPAN, "parent_span_id": "c" * 16, "status": "error"}, _SPAN),
    _raw({**_SPAN, "attributes": {"tokenbus.tenant": "acme", "n": 3, "x": 1.5, "ok": True}}),
    _raw({**_SPAN, "parent_span_id": None, "start_ns": 0, "end_ns": 0}),
]


@pytest.mark.parametrize("raw", ACCEPTED_BY_BOTH)
def test_what_the_strict_reading_accepts_pydantic_accepts_with_the_same_values(
    raw: bytes,
) -> None:
    fast = msgspec.json.decode(raw, type=SpanBatchRecord)
    assert _values(fast) == _values(decode(SpanBatch, raw))
    assert isinstance(decode_spans(raw), SpanBatchRecord)


REFUSED_BY_BOTH = [
    None,
    b"not json",
    _raw(),  # no spans
    _raw({**_SPAN, "trace_id": "A" * 32}),
    _raw({**_SPAN, "trace_id": "a" * 31 + "\n"}),
    _raw({**_SPAN, "span_id": "b" * 16 + "\n"}),
    _raw(_SPAN, {**_SPAN, "parent_span_id": "c" * 15 + "g"}),  # in a later span
    _raw(_SPAN, {**_SPAN, "span_id": "b" * 15 + "B"}),
    _raw({**_SPAN, "trace_id": "a" * 33}),
    _raw({**_SPAN, "name": ""}),
    _raw({**_SPAN, "start_ns": -1}),
    _raw({**_SPAN, "status": "fine"}),
    _raw({**_SPAN, "attributes": {"list": [1]}}),
    _raw(_SPAN, schema_version=2),
    _raw({**_SPAN, "extra": 1}),
]


@pytest.mark.parametrize("raw", REFUSED_BY_BOTH)
def test_what_both_refuse_is_refused_with_pydantics_reason(raw: bytes | None) -> None:
    with pytest.raises(SchemaError):
        decode_spans(raw)


def test_what_only_pydantic_accepts_still_reads() -> None:
    lax = _raw({**_SPAN, "start_ns": "5"})  # a string for a number: pydantic's lax mode
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(lax, type=SpanBatchRecord)
    batch = decode_spans(lax)
    assert isinstance(batch, SpanBatch) and batch.spans[0].start_ns == 5
