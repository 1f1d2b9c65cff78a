from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from schemas import (
    INTERNAL_FIELDS,
    FinishReason,
    InferenceRequest,
    SchemaError,
    TokenChunk,
    TokenChunkBatch,
    UsageEvent,
    WorkItem,
    decode,
    encode,
)
from schemas.export import BUS_MESSAGES, render, schema_path

BODY: dict[str, object] = {
    "request_id": "req_1",
    "session_id": "sess_1",
    "tenant_id": "acme",
    "model": "tiny-llama",
    "prompt": "hello",
    "reply_to": "tokenbus.replies.acme.c1",
}


def request(*, without: tuple[str, ...] = (), **overrides: object) -> InferenceRequest:
    fields = {k: v for k, v in BODY.items() if k not in without}
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
        (orjson.dumps({"request_id": "r"}), "model: Field required; reply_to: Field required"),
    ],
)
def test_bad_bytes_raise_schema_error_with_a_reason(raw: bytes | None, reason: str) -> None:
    with pytest.raises(SchemaError, match=reason):
        decode(InferenceRequest, raw)


def test_prompt_and_messages_are_exclusive() -> None:
    with pytest.raises(ValueError, match="exactly one of 'prompt' and 'messages'"):
        request(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="exactly one"):
        request(without=("prompt",))


def test_priority_and_tenant_are_validated() -> None:
    with pytest.raises(ValueError, match="priority"):
        request(priority=3)
    with pytest.raises(ValueError, match="tenant_id"):
        request(tenant_id="a/b")
    with pytest.raises(ValueError, match="tenant_id"):
        request(tenant_id="a.b")  # a dot would put its reply topics under another's prefix


def test_last_chunk_is_the_one_with_a_finish_reason() -> None:
    assert not TokenChunk(request_id="r", tenant_id="t", seq=0).is_last
    assert TokenChunk(request_id="r", tenant_id="t", seq=1, finish_reason=FinishReason.STOP).is_last


def test_a_batch_round_trips_its_chunks_in_order() -> None:
    chunks = [
        TokenChunk(request_id="r1", tenant_id="t", seq=0, text="a", token_ids=[1], num_tokens=1),
        TokenChunk(request_id="r2", tenant_id="t", seq=4, finish_reason=FinishReason.STOP),
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


INTERNAL_VALUES: dict[str, object] = {
    "attempt": 1,
    "worker_id": "w1",
    "worker_incarnation": "run-1",
    "dispatched_at": "2026-01-01T00:00:00Z",
    "admitted_at": "2026-01-01T00:00:00Z",
    "resume_token_ids": [1, 2],
    "resume_seq": 2,
    "overload_tier": 0,
    "cache_salt": "other-tenant",
    "flags": ["usage_from_replies"],
    "adapter": {"name": "other-adapter", "path": "/etc", "lora_int_id": 1},
    "key_sha256": "0" * 64,
}


def test_every_internal_field_has_a_value_here() -> None:
    assert set(INTERNAL_VALUES) == INTERNAL_FIELDS


@pytest.mark.parametrize("name", sorted(INTERNAL_FIELDS))
def test_an_internal_field_alone_is_refused_with_a_reason_naming_it(name: str) -> None:
    raw = orjson.dumps({**BODY, name: INTERNAL_VALUES[name]})
    with pytest.raises(SchemaError, match=rf"{name}: set by tokenbus, not by producers"):
        decode(InferenceRequest, raw)


@pytest.mark.parametrize(
    "name", ["session_id", "tenant_id", "created_at", "priority", "sampling", "messages"]
)
def test_null_is_refused_with_a_reason_naming_the_field(name: str) -> None:
    with pytest.raises(SchemaError, match=rf"{name}: null is not allowed"):
        decode(InferenceRequest, orjson.dumps({**BODY, name: None}))


def test_a_body_with_only_the_required_fields_is_accepted() -> None:
    minimal = {"request_id": "r", "model": "m", "prompt": "p", "reply_to": "tokenbus.replies.a.c"}
    parsed = decode(InferenceRequest, orjson.dumps(minimal))
    assert parsed.session_id is None and parsed.tenant_id is None and parsed.created_at is None


def _satisfies(body: dict[str, Any], clause: dict[str, Any]) -> bool:
    """The ``required`` / ``not`` subset of JSON Schema the exported ``oneOf`` uses."""
    assert set(clause) <= {"required", "not"}, f"unexpected keywords in {clause}"
    if not all(name in body for name in clause.get("required", [])):
        return False
    return "not" not in clause or not _satisfies(body, clause["not"])


def schema_accepts(schema: dict[str, Any], body: dict[str, Any]) -> bool:
    """A JSON Schema validator's verdict when ``jsonschema`` is installed; else the
    ``oneOf`` evaluated by hand (the rest of the schema is checked by pydantic)."""
    try:
        import jsonschema
    except ImportError:
        return len([c for c in schema["oneOf"] if _satisfies(body, c)]) == 1
    validator = jsonschema.Draft202012Validator(schema)
    return bool(validator.is_valid(body))


@pytest.mark.parametrize(
    ("inputs", "valid"),
    [
        ({"prompt": "hi"}, True),
        ({"messages": [{"role": "user", "content": "hi"}]}, True),
        ({}, False),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, False),
    ],
)
def test_the_exported_schema_wants_exactly_one_of_prompt_and_messages(
    inputs: dict[str, object], valid: bool
) -> None:
    schema = orjson.loads(schema_path(InferenceRequest).read_bytes())
    body = {k: v for k, v in BODY.items() if k != "prompt"} | inputs
    assert schema_accepts(schema, body) is valid
    # The code agrees with the published schema.
    if valid:
        decode(InferenceRequest, orjson.dumps(body))
    else:
        with pytest.raises(SchemaError, match="exactly one"):
            decode(InferenceRequest, orjson.dumps(body))


def test_the_exported_schema_never_offers_null_or_internal_fields() -> None:
    schema = orjson.loads(schema_path(InferenceRequest).read_bytes())
    assert schema["additionalProperties"] is False
    assert not INTERNAL_FIELDS & set(schema["properties"])
    assert b'"null"' not in orjson.dumps(schema["properties"])
    assert set(schema["required"]) == {"request_id", "model", "reply_to"}


def test_a_work_item_s_engine_id_is_unique_across_tenants_and_attempts() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)

    def item(tenant: str, attempt: int) -> WorkItem:
        return WorkItem(
            request_id="r",
            session_id="s",
            tenant_id=tenant,
            model="m",
            prompt="p",
            reply_to="tokenbus.replies.a.c",
            created_at=now,
            admitted_at=now,
            cache_salt=tenant,
            attempt=attempt,
        )

    ids = {item(t, n).engine_request_id for t in ("a", "b") for n in (0, 1)}
    assert len(ids) == 4
