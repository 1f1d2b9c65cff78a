"""The sink's strict reading of usage records agrees with ``schemas.decode`` on every input."""

from datetime import UTC, datetime

import msgspec
import orjson
import pytest

from billing.usage_codec import UsageRecord, decode_usage, decode_usages
from schemas import SchemaError, UsageEvent, decode

_FIXED = {
    "request_id": "req_1",
    "session_id": "sess_1",
    "tenant_id": "acme",
    "model": "tiny",
    "status": "ok",
    "created_at": "2026-01-01T12:00:00Z",
    "finished_at": "2026-01-01T12:00:01.250+02:00",
}


def _raw(**fields: object) -> bytes:
    return orjson.dumps({**_FIXED, **fields})


def _values(event: object) -> dict[str, object]:
    return {name: getattr(event, name) for name in UsageEvent.model_fields}


def test_the_record_has_the_events_fields_and_defaults() -> None:
    assert set(UsageRecord.__struct_fields__) == set(UsageEvent.model_fields)
    bare = {k: v for k, v in _FIXED.items() if k != "finished_at"}
    fast = msgspec.json.decode(orjson.dumps(bare), type=UsageRecord)
    slow = decode(UsageEvent, orjson.dumps(bare))
    for name, field in UsageEvent.model_fields.items():
        if field.default_factory is None:
            assert getattr(fast, name) == getattr(slow, name) == field.default or name in bare
    assert fast.flags == slow.flags == []
    assert abs((fast.finished_at - slow.finished_at).total_seconds()) < 5  # both "now"


ACCEPTED_BY_BOTH = [
    _raw(),
    _raw(attempt=3, priority=0, overload_tier=2, flags=["peak"], adapter="sql", last_seq=9),
    _raw(worker_id=None, ttft_ms=None, error_code="oom", status="failed", finish_reason="error"),
    _raw(num_prompt_tokens=2**32 - 1, queue_ms=5, total_ms=1.5e3, key_sha256="ab" * 32),
    _raw(created_at="2026-01-01T12:00:00", schema_version=1),  # naive: both keep it naive
    _raw(created_at="2026-01-01T14:00:00.123456+02:00"),
]


@pytest.mark.parametrize("raw", ACCEPTED_BY_BOTH)
def test_what_the_strict_reading_accepts_pydantic_accepts_with_the_same_values(
    raw: bytes,
) -> None:
    fast = msgspec.json.decode(raw, type=UsageRecord)

    assert _values(fast) == _values(decode(UsageEvent, raw))
    assert _values(decode_usage(raw)) == _values(fast)


LAX = [
    _raw(priority="2"),  # pydantic's lax mode coerces these; the strict reading refuses
    _raw(num_prompt_tokens=10.0),
    _raw(created_at=1767268800),
    _raw(created_at="2026-01-01"),
    _raw(ttft_ms="5.5"),
]


@pytest.mark.parametrize("raw", LAX)
def test_what_only_pydantic_accepts_is_read_by_pydantic(raw: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw, type=UsageRecord)

    event = decode_usage(raw)

    assert isinstance(event, UsageEvent)
    assert _values(event) == _values(decode(UsageEvent, raw))


REFUSED = [
    None,
    b"{not json",
    b"[]",
    _raw()[:-1] + b',"queue_ms":NaN}',
    _raw()[:-1] + b',"num_prompt_tokens":' + str(2**70).encode() + b"}",
    _raw(priority=3),
    _raw(overload_tier=-1),
    _raw(schema_version=2),
    _raw(status="done"),
    _raw(surprise=1),
    _raw(model=None),
    {k: v for k, v in _FIXED.items() if k != "tenant_id"},
]


@pytest.mark.parametrize("raw", REFUSED)
def test_what_neither_accepts_fails_with_pydantics_reason(
    raw: bytes | dict[str, str] | None,
) -> None:
    data = orjson.dumps(raw) if isinstance(raw, dict) else raw
    with pytest.raises(SchemaError) as expected:
        decode(UsageEvent, data)

    with pytest.raises(SchemaError) as got:
        decode_usage(data)

    assert str(got.value) == str(expected.value)


def test_times_read_strictly_are_the_same_instants() -> None:
    fast = decode_usage(_raw())

    assert isinstance(fast, UsageRecord)
    assert fast.created_at == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert fast.finished_at == datetime(2026, 1, 1, 10, 0, 1, 250_000, tzinfo=UTC)


@pytest.mark.parametrize("value", [-1, 2**32])
@pytest.mark.parametrize("field", ["attempt", "num_prompt_tokens", "num_cached_tokens"])
def test_a_count_no_row_holds_is_read_by_pydantic_which_keeps_it_for_the_sink_to_refuse(
    field: str, value: int
) -> None:
    raw = _raw(**{field: value})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw, type=UsageRecord)

    event = decode_usage(raw)

    assert isinstance(event, UsageEvent)
    assert getattr(event, field) == value


def test_a_fetch_is_read_strictly_in_one_call_as_record_by_record() -> None:
    read = decode_usages(ACCEPTED_BY_BOTH)

    assert read is not None
    assert [_values(e) for e in read] == [_values(decode_usage(raw)) for raw in ACCEPTED_BY_BOTH]
    assert all(isinstance(e, UsageRecord) for e in read)
    assert decode_usages([]) == []


@pytest.mark.parametrize("odd", [*LAX, None, b"{not json", _raw(num_completion_tokens=-1)])
def test_a_fetch_with_any_record_the_strict_reading_refuses_is_left_to_record_by_record(
    odd: bytes | None,
) -> None:
    assert decode_usages([_raw(), odd, _raw(attempt=1)]) is None
