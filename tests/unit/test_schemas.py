from __future__ import annotations

import orjson
import pytest

from schemas import (
    InferenceRequest,
    SchemaError,
    TokenChunk,
    TokenChunkBatch,
    UsageEvent,
    decode,
    encode,
)
from schemas.export import BUS_MESSAGES, render, schema_path


def request(**overrides: object) -> InferenceRequest:
    fields: dict[str, object] = {
        "request_id": "req_1",
        "session_id": "sess_1",
        "tenant_id": "acme",
        "model": "tiny-llama",
        "prompt": "hello",
        "reply_to": "tokenbus.replies.c1",
    }
    fields.update(overrides)
    return InferenceRequest.model_validate(fields)


def test_round_trip_keeps_every_field() -> None:
    original = request(priority=0, sampling={"max_tokens": 7, "stop": ["\n"]})
    assert decode(InferenceRequest, encode(original)) == original


@pytest.mark.parametrize("model", BUS_MESSAGES, ids=lambda m: m.__name__)
def test_exported_json_schema_is_current(model: type) -> None:
    path = schema_path(model)
    assert path.exists(), f"run `python -m schemas.export` to create {path.name}"
    assert path.read_bytes() == render(model), f"{path.name} is stale: run schemas.export"


def test_unknown_version_is_named_in_the_error() -> None:
    raw = orjson.dumps({**orjson.loads(encode(request())), "schema_version": 2})
    with pytest.raises(SchemaError, match="unknown schema_version 2"):
        decode(InferenceRequest, raw)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (None, "tombstone"),
        (orjson.dumps({"request_id": "r"}), "session_id: Field required"),
    ],
)
def test_bad_bytes_raise_schema_error_with_a_reason(raw: bytes | None, reason: str) -> None:
    with pytest.raises(SchemaError, match=reason):
        decode(InferenceRequest, raw)


def test_prompt_and_messages_are_exclusive() -> None:
    with pytest.raises(ValueError, match="exactly one of 'prompt' and 'messages'"):
        request(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="exactly one"):
        request(prompt=None)


def test_priority_and_tenant_are_validated() -> None:
    with pytest.raises(ValueError, match="priority"):
        request(priority=3)
    with pytest.raises(ValueError, match="tenant_id"):
        request(tenant_id="a/b")


def test_last_chunk_is_the_one_with_a_finish_reason() -> None:
    assert not TokenChunk(request_id="r", tenant_id="t", seq=0).is_last
    assert TokenChunk(request_id="r", tenant_id="t", seq=1, finish_reason="stop").is_last


def test_a_batch_round_trips_its_chunks_in_order() -> None:
    chunks = [
        TokenChunk(request_id="r1", tenant_id="t", seq=0, text="a", token_ids=[1], num_tokens=1),
        TokenChunk(request_id="r2", tenant_id="t", seq=4, finish_reason="stop"),
        TokenChunk(request_id="r1", tenant_id="t", seq=1, text="b", token_ids=[2], num_tokens=1),
    ]
    batch = decode(TokenChunkBatch, encode(TokenChunkBatch(tenant_id="t", chunks=chunks)))
    assert batch.chunks == chunks


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"tenant_id": "t", "chunks": []}, "chunks: List should have at least 1 item"),
        (
            {"tenant_id": "t", "chunks": [{"request_id": "r", "tenant_id": "u", "seq": 0}]},
            "every chunk must belong to the batch's tenant_id",
        ),
        # A bare chunk, as reply topics carried before batches: named, not half-read.
        ({"request_id": "r", "tenant_id": "t", "seq": 0}, "chunks: Field required"),
    ],
)
def test_a_bad_batch_raises_schema_error_with_a_reason(
    fields: dict[str, object], reason: str
) -> None:
    with pytest.raises(SchemaError, match=reason):
        decode(TokenChunkBatch, orjson.dumps(fields))


def test_usage_event_requires_a_status() -> None:
    with pytest.raises(SchemaError, match="status"):
        decode(
            UsageEvent,
            orjson.dumps(
                {
                    "request_id": "r",
                    "session_id": "s",
                    "tenant_id": "t",
                    "model": "m",
                    "created_at": "2026-01-01T00:00:00Z",
                }
            ),
        )
