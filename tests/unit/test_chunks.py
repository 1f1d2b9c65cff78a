"""The reply topics' codec against the pydantic models it mirrors."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from schemas import (
    ErrorInfo,
    FinishReason,
    SchemaError,
    TokenChunk,
    TokenChunkBatch,
    decode,
    encode,
)
from tokenbus.chunks import (
    Chunk,
    ChunkBatch,
    ChunkError,
    decode_batch,
    encode_batch,
    from_model,
    to_model,
)

KINDS = {
    "token": TokenChunk(
        request_id="r1", tenant_id="t", seq=3, text=" tok", token_ids=[7], num_tokens=1
    ),
    "several tokens": TokenChunk(
        request_id="r1", tenant_id="t", seq=4, text="ab c", token_ids=[1, 2, 3], num_tokens=3
    ),
    "tokens still decoding": TokenChunk(
        request_id="r1", tenant_id="t", seq=5, token_ids=[200], num_tokens=1
    ),
    "last": TokenChunk(
        request_id="r1",
        tenant_id="t",
        seq=9,
        text=".",
        token_ids=[2],
        num_tokens=1,
        finish_reason=FinishReason.LENGTH,
        num_prompt_tokens=150,
    ),
    "abort": TokenChunk(request_id="r1", tenant_id="t", seq=0, finish_reason=FinishReason.ABORT),
    "engine error": TokenChunk(
        request_id="r1",
        tenant_id="t",
        seq=2,
        finish_reason=FinishReason.ERROR,
        error=ErrorInfo(code="engine_error", message="RuntimeError: boom"),
    ),
    "refusal": TokenChunk(
        request_id="r1",
        tenant_id="t",
        seq=0,
        finish_reason=FinishReason.REJECTED,
        error=ErrorInfo(
            code="quota_exceeded",
            message="over the tenant's tokens per minute",
            retry_after_s=12.5,
            limit_kind="tokens",
            num_limit=1000,
            num_remaining=3,
        ),
    ),
    "unicode": TokenChunk(
        request_id="r.1:x_y-z", tenant_id="t", seq=1, text='é\u2028"\\ 🙂', num_tokens=0
    ),
}


def test_the_structs_have_the_models_fields_and_defaults() -> None:
    pairs: list[tuple[type[msgspec.Struct], type[BaseModel]]] = [
        (Chunk, TokenChunk),
        (ChunkError, ErrorInfo),
        (ChunkBatch, TokenChunkBatch),
    ]
    for struct, model in pairs:
        info = msgspec.structs.fields(struct)
        assert {f.name for f in info} == set(model.model_fields), struct.__name__
        for f in info:
            field = model.model_fields[f.name]
            assert f.required == field.is_required(), f"{struct.__name__}.{f.name}"
            if not f.required:
                default = (
                    f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
                )
                assert default == field.get_default(call_default_factory=True), f.name


@pytest.mark.parametrize("kind", list(KINDS))
def test_what_the_models_encode_the_codec_decodes_to_the_same(kind: str) -> None:
    model = KINDS[kind]
    raw = encode(TokenChunkBatch(tenant_id="t", chunks=[model, model]))
    batch = decode_batch(raw)
    assert batch.tenant_id == "t" and len(batch.chunks) == 2
    assert to_model(batch.chunks[0]) == model
    assert batch.chunks[0].is_last == model.is_last
    assert batch.chunks[0] == from_model(model)


@pytest.mark.parametrize("kind", list(KINDS))
def test_what_the_codec_encodes_the_models_decode_to_the_same(kind: str) -> None:
    model = KINDS[kind]
    raw = encode_batch("t", [from_model(model)])
    assert decode(TokenChunkBatch, raw) == TokenChunkBatch(tenant_id="t", chunks=[model])
    assert orjson.loads(raw)["schema_version"] == 1


def test_the_finish_reason_decodes_to_the_enum_member() -> None:
    (chunk,) = decode_batch(encode(TokenChunkBatch(tenant_id="t", chunks=[KINDS["last"]]))).chunks
    assert chunk.finish_reason is FinishReason.LENGTH


GOOD_CHUNK: dict[str, Any] = {"request_id": "r1", "tenant_id": "t", "seq": 0}


def batch_of(*chunks: dict[str, Any], **fields: Any) -> bytes:
    return orjson.dumps({"schema_version": 1, "tenant_id": "t", "chunks": list(chunks), **fields})


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "empty message (tombstone)"),
        (b"", "not JSON"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'"a string"', "expected a JSON object"),
        (orjson.dumps({"tenant_id": "t"}), "missing required field `chunks`"),
        (orjson.dumps({"chunks": [GOOD_CHUNK]}), "missing required field `tenant_id`"),
        (batch_of(), "Expected `array` of length >= 1 - at `$.chunks`"),
        (batch_of(schema_version=2), "unknown schema_version 2 for TokenChunkBatch"),
        (batch_of(GOOD_CHUNK, extra=1), "unknown field `extra`"),
        (batch_of(GOOD_CHUNK, tenant_id=7), "Expected `str`, got `int` - at `$.tenant_id`"),
        (batch_of({"tenant_id": "t", "seq": 0}), "missing required field `request_id`"),
        (batch_of({"request_id": "r1", "seq": 0}), "missing required field `tenant_id`"),
        (batch_of({"request_id": "r1", "tenant_id": "t"}), "missing required field `seq`"),
        (batch_of({**GOOD_CHUNK, "seq": "1"}), "Expected `int`, got `str` - at `$.chunks[0].seq`"),
        (
            batch_of({**GOOD_CHUNK, "seq": True}),
            "Expected `int`, got `bool` - at `$.chunks[0].seq`",
        ),
        (
            batch_of({**GOOD_CHUNK, "seq": 1.5}),
            "Expected `int`, got `float` - at `$.chunks[0].seq`",
        ),
        (batch_of({**GOOD_CHUNK, "seq": -1}), "Expected `int` >= 0 - at `$.chunks[0].seq`"),
        (batch_of({**GOOD_CHUNK, "num_tokens": -2}), "`int` >= 0 - at `$.chunks[0].num_tokens`"),
        (
            b'{"tenant_id": "t", "chunks": [{"request_id": "r1", "tenant_id": "t", '
            b'"seq": 123456789012345678901234567890}]}',
            "at `$.chunks[0].seq`",
        ),
        (
            b'{"tenant_id": "t", "chunks": [{"request_id": "r1", "tenant_id": "t", "seq": 0, '
            b'"token_ids": [-123456789012345678901234567890]}]}',
            "at `$.chunks[0].token_ids[0]`",
        ),
        (batch_of({**GOOD_CHUNK, "text": None}), "Expected `str`, got `null`"),
        (batch_of({**GOOD_CHUNK, "token_ids": ["7"]}), "at `$.chunks[0].token_ids[0]`"),
        (batch_of({**GOOD_CHUNK, "finish_reason": "done"}), "Invalid enum value 'done'"),
        (batch_of({**GOOD_CHUNK, "error": {"code": "x"}}), "missing required field `message`"),
        (
            batch_of({**GOOD_CHUNK, "error": {"code": "x", "message": "m", "limit_kind": "$"}}),
            "at `$.chunks[0].error.limit_kind`",
        ),
        (batch_of({**GOOD_CHUNK, "schema_version": 2}), "at `$.chunks[0].schema_version`"),
        (batch_of({**GOOD_CHUNK, "oops": 1}), "unknown field `oops` - at `$.chunks[0]`"),
        (
            batch_of(GOOD_CHUNK, {**GOOD_CHUNK, "tenant_id": "u"}),
            "chunks[1] is of tenant 'u', the batch of tenant 't'",
        ),
    ],
)
def test_a_malformed_record_is_refused_with_its_reason(raw: bytes | None, reason: str) -> None:
    with pytest.raises(SchemaError) as refused:
        decode_batch(raw)
    assert reason in str(refused.value)


def test_a_malformed_record_the_codec_refuses_the_model_refuses_too() -> None:
    """The codec is no laxer than the published schema: a sample of shapes both refuse."""
    for raw in [
        batch_of(),
        batch_of({**GOOD_CHUNK, "seq": -1}),
        batch_of({**GOOD_CHUNK, "oops": 1}),
        batch_of(GOOD_CHUNK, {**GOOD_CHUNK, "tenant_id": "u"}),
    ]:
        with pytest.raises(SchemaError):
            decode(TokenChunkBatch, raw)


texts = st.text(max_size=20)
ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-.:", min_size=1, max_size=30)
errors = st.none() | st.builds(
    ErrorInfo,
    code=texts,
    message=texts,
    retry_after_s=st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False),
    limit_kind=st.none() | st.sampled_from(["tokens", "requests"]),
    num_limit=st.none() | st.integers(min_value=0, max_value=2**40),
    num_remaining=st.none() | st.integers(min_value=-(2**40), max_value=2**40),
)
chunks = st.builds(
    TokenChunk,
    request_id=ids,
    tenant_id=st.just("t"),
    seq=st.integers(min_value=0, max_value=2**31),
    text=texts,
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=8),
    num_tokens=st.integers(min_value=0, max_value=64),
    finish_reason=st.none() | st.sampled_from(list(FinishReason)),
    error=errors,
    num_prompt_tokens=st.none() | st.integers(min_value=0, max_value=2**20),
)


@given(st.lists(chunks, min_size=1, max_size=6))
def test_any_batch_round_trips_through_the_codec_and_the_model(models: list[TokenChunk]) -> None:
    batch = TokenChunkBatch(tenant_id="t", chunks=models)
    decoded = decode_batch(encode(batch))
    assert [to_model(c) for c in decoded.chunks] == models
    assert decode(TokenChunkBatch, encode_batch("t", list(decoded.chunks))) == batch


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)  # what orjson writes
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


@given(
    st.dictionaries(
        st.sampled_from(["schema_version", "tenant_id", "chunks", "other"]), json_values
    )
    | json_values
)
def test_any_other_json_is_refused_with_a_schema_error_or_accepted_as_the_model_would(
    value: Any,
) -> None:
    raw = orjson.dumps(value)
    try:
        batch = decode_batch(raw)
    except SchemaError as exc:
        assert str(exc)
        return
    assert decode(TokenChunkBatch, raw).chunks == [to_model(c) for c in batch.chunks]


@given(st.binary(max_size=40))
def test_any_bytes_are_refused_with_a_schema_error(raw: bytes) -> None:
    try:
        decode_batch(raw)
    except SchemaError:
        return
    # Bytes that happen to be a good batch: only a well-formed JSON object can be one.
    assert raw.strip().startswith(b"{")
