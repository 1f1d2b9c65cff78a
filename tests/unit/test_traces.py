"""billing.traces: spans as rows, a request's trace as a timeline, on the embedded engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence

import orjson
import pytest

from billing.storage import ClickHouseStore
from billing.traces import (
    SPAN_COLUMNS,
    TRACE_SQL,
    lookup_problem,
    render,
    span_rows,
    timeline,
)
from schemas import decode
from schemas.spans import SpanBatch
from tokenbus.config import Settings
from tokenbus.tracing import ATTR_TENANT, Tracing, extract, inject, span_attributes

SPAN_ROW = {
    "trace_id": "t" * 32,
    "span_id": "s" * 16,
    "parent_span_id": "",
    "name": "job.admit",
    "service": "tokenbus-job",
    "start_time": "2026-03-02T12:00:00.000001",
    "duration_us": 1500,
    "status": "ok",
    "request_id": "",
    "attempt": -1,
}


@pytest.fixture
def store() -> Iterator[ClickHouseStore]:
    with ClickHouseStore("chdb://memory") as store:
        yield store


def traced_request(tenant: str, request_id: str) -> list[SpanBatch]:
    """Spans of one request through three services, handed on by Kafka headers, with a
    second attempt on the worker; and one unrelated request."""
    client, job, worker = (Tracing(Settings(), name) for name in ("client", "job", "worker"))
    attrs = span_attributes(tenant=tenant, request_id=request_id, session_id="s")
    headers: list[tuple[str, bytes]] = []
    with client.tracer.start_as_current_span("client.request", attributes=attrs):
        inject(headers)
        admit = {ATTR_TENANT: tenant}  # no request id: found through its trace
        with job.tracer.start_as_current_span(
            "job.admit", context=extract(headers), attributes=admit
        ):
            inject(headers)
        for attempt in (0, 1):
            worker_attrs = {**attrs, **span_attributes(tenant=tenant, request_id=request_id)}
            worker_attrs["tokenbus.attempt"] = attempt
            with worker.tracer.start_as_current_span(
                "worker.generate", context=extract(headers), attributes=worker_attrs
            ):
                pass
    other = span_attributes(tenant=tenant, request_id="unrelated")
    with client.tracer.start_as_current_span("client.request", attributes=other):
        pass
    batches: list[SpanBatch] = []

    async def publish(
        topic: str, key: bytes, value: bytes, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> None:
        batches.append(decode(SpanBatch, value))

    for tracing in (client, job, worker):
        asyncio.run(tracing.flush(publish))
    return batches


def test_a_requests_trace_comes_back_as_one_tree(store: ClickHouseStore) -> None:
    batches = traced_request("acme", "r1")
    rows = [row for batch in batches for row in span_rows(batch)]
    store.insert_spans(rows)
    store.insert_spans(rows)  # redelivered: merged away by the key
    found = store.query(TRACE_SQL, {"tenant": "acme", "request_id": "r1"})
    steps = timeline(found)
    assert [(s.depth, s.name, s.attempt) for s in steps] == [
        (0, "client.request", -1),
        (1, "job.admit", -1),
        (2, "worker.generate", 0),
        (2, "worker.generate", 1),
    ]
    assert steps[0].offset_ms == 0.0
    assert all(s.offset_ms >= 0 and s.duration_ms >= 0 for s in steps)
    assert {s.service for s in steps} == {"tokenbus-client", "tokenbus-job", "tokenbus-worker"}
    text = render(steps)
    assert text.splitlines()[0] == f"trace {steps[0].trace_id}"
    assert "      worker.generate" in text and "attempt 1" in text


def test_an_attempt_outside_its_int32_column_is_stored_as_none(store: ClickHouseStore) -> None:
    attempts = [2**31 - 1, 2**31, -(2**31) - 1, 2**40]
    now_ns = time.time_ns()  # within the table's TTL: older spans may be merged away
    spans = [
        {
            "trace_id": "a" * 32,
            "span_id": f"{n:016x}",
            "name": "worker.generate",
            "service": "tokenbus-worker",
            "start_ns": now_ns,
            "end_ns": now_ns + 100_000_000,
            "attributes": {"tokenbus.request_id": "r1", "tokenbus.attempt": attempt},
        }
        for n, attempt in enumerate(attempts)
    ]
    batch = decode(SpanBatch, orjson.dumps({"tenant_id": "acme", "spans": spans}))
    store.insert_spans(span_rows(batch))  # one out of range failed the whole insert
    found = store.query(TRACE_SQL, {"tenant": "acme", "request_id": "r1"})
    assert sorted(s.attempt for s in timeline(found)) == [-1, -1, -1, 2**31 - 1]
    # the attribute keeps what the span said
    assert {dict(s.attributes)["tokenbus.attempt"] for s in timeline(found)} == set(
        map(str, attempts)
    )


def test_another_tenant_reads_nothing_of_it(store: ClickHouseStore) -> None:
    store.insert_spans([row for batch in traced_request("acme", "r1") for row in span_rows(batch)])
    assert store.query(TRACE_SQL, {"tenant": "globex", "request_id": "r1"}) == []


def test_a_span_whose_parent_is_missing_starts_a_tree_of_its_own() -> None:
    batches = traced_request("acme", "r1")
    rows = [
        row
        for batch in batches
        if batch.spans[0].service != "tokenbus-client"
        for row in span_rows(batch)
    ]
    found = [dict(zip(SPAN_COLUMNS, row, strict=True)) for row in rows]
    steps = timeline(found)
    assert [(s.depth, s.name) for s in steps] == [
        (0, "job.admit"),
        (1, "worker.generate"),
        (1, "worker.generate"),
    ]
    assert render([]) == ""


def test_each_step_carries_its_span_s_attributes_sorted(store: ClickHouseStore) -> None:
    store.insert_spans([row for batch in traced_request("acme", "r1") for row in span_rows(batch)])
    steps = timeline(store.query(TRACE_SQL, {"tenant": "acme", "request_id": "r1"}))
    second = steps[3].attributes
    assert second == tuple(sorted(second))
    assert ("tokenbus.attempt", "1") in second and ("tokenbus.request_id", "r1") in second
    # Rows that crossed the query server's JSON carry the map as an object, too.
    assert timeline([{**SPAN_ROW, "attributes": {"b": 2, "a": "x"}}])[0].attributes == (
        ("a", "x"),
        ("b", "2"),
    )


@pytest.mark.parametrize(
    ("request_id", "tenant", "problem"),
    [
        ("r1", "", "tenant is required"),
        ("r1", "<b>", "tenant must be"),
        ("r1", "acme\n", "tenant must be"),
        ("r1", "a.b", "tenant must be"),
        ("<script>alert(1)</script>", "acme", "request id must be"),
        ("r1\n", "acme", "request id must be"),
        ("r/1", "acme", "request id must be"),
        ("r" * 129, "acme", "request id must be"),
    ],
)
def test_a_lookup_of_the_wrong_shape_is_refused_without_echoing_it(
    request_id: str, tenant: str, problem: str
) -> None:
    found = lookup_problem(request_id, tenant)
    assert found is not None and problem in found
    assert "<" not in found


def test_ids_the_bus_admits_are_looked_up() -> None:
    assert lookup_problem("chatcmpl-01J:ab.c_d", "br-alice_2") is None
    assert lookup_problem("r" * 128, "t" * 128) is None
