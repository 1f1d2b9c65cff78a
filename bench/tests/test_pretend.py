from __future__ import annotations

from datetime import UTC, datetime

import orjson

from bench.pretend import _dispatched_at


def test_the_forward_says_when_the_job_picked_its_worker() -> None:
    at = datetime(2026, 12, 5, 11, 0, 0, 250_000, tzinfo=UTC)
    value = orjson.dumps({"request_id": "r", "dispatched_at": at.isoformat()})
    assert _dispatched_at(value) == at.timestamp()


def test_a_record_without_a_readable_dispatch_time_has_none() -> None:
    assert _dispatched_at(orjson.dumps({"request_id": "r"})) is None
    assert _dispatched_at(orjson.dumps({"dispatched_at": None})) is None
    assert _dispatched_at(orjson.dumps({"dispatched_at": "yesterday"})) is None
    assert _dispatched_at(b"not json") is None
    assert _dispatched_at(None) is None
    assert _dispatched_at(b"[1, 2]") is None
