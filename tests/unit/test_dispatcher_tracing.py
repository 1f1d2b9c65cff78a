"""The job's spans: job.admit under the record's trace context, job.queue under it, and
the forward carrying job.queue's context to the worker; an unproven request files its
span under no tenant."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from schemas import WorkItem, decode, encode
from stream_jobs.dispatcher import Dispatcher, Outcome, Record
from tests.unit.fakes import (
    Recorder,
    memory_dispatcher,
    service_headers,
    taken_spans,
)
from tests.unit.test_dispatcher import heartbeat, request
from tokenbus.config import Settings
from tokenbus.span_buffer import NO_TENANT
from tokenbus.span_path import path_ns
from tokenbus.tracing import Tracing, inject, with_path


def traced_dispatcher(tmp_path: Path, recorder: Recorder) -> tuple[Dispatcher, Tracing]:
    settings = Settings(home=tmp_path, default_priority_class=0)
    tracing = Tracing(settings, "job")
    dispatcher = memory_dispatcher(settings, recorder, tracer=tracing.tracer)
    return dispatcher, tracing


async def test_a_forwarded_request_is_traced_from_the_producers_span(tmp_path: Path) -> None:
    recorder = Recorder()
    dispatcher, tracing = traced_dispatcher(tmp_path, recorder)
    client = Tracing(Settings(), "client")
    headers = service_headers("t")
    sent_ns = time.time_ns() - 2_000_000  # where the sender's path stood: 2 ms ago
    with client.tracer.start_as_current_span("client.request") as sent:
        inject(headers, with_path(sent_ns))
    dispatcher.observe_heartbeat(heartbeat())
    loop = asyncio.create_task(dispatcher.run())
    outcome = await dispatcher.handle_request(Record("p", 0, 0, b"t", encode(request(1)), headers))
    loop.cancel()
    assert outcome is Outcome.FORWARDED
    assert tracing.buffer is not None
    spans = {span["name"]: span for span in taken_spans(tracing.buffer)["t"]}
    admit, queued = spans["job.admit"], spans["job.queue"]
    trace_id = f"{sent.get_span_context().trace_id:032x}"
    assert admit["trace_id"] == queued["trace_id"] == trace_id
    assert admit["parent_span_id"] == f"{sent.get_span_context().span_id:016x}"
    assert queued["parent_span_id"] == admit["span_id"]
    assert admit["attributes"]["tokenbus.outcome"] == "admitted"
    assert admit["attributes"]["tokenbus.request_id"] == "r1"
    assert queued["attributes"]["tokenbus.worker"] == "w"
    assert int(queued["start_ns"]) <= int(queued["end_ns"])
    # The path to the first token: the bus's hop from the sender's stamp to the take,
    # job.admit, job.queue from admission's end to the forward's send, each from where
    # the one before ended.
    hop = spans["bus.request"]
    assert hop["parent_span_id"] == admit["parent_span_id"]
    assert hop["attributes"] == {"tokenbus.tenant": "t"}
    assert (int(hop["start_ns"]), hop["end_ns"]) == (sent_ns, admit["start_ns"])
    assert admit["end_ns"] == queued["start_ns"]
    # The forward carries job.queue's context: the worker's span is its child.
    (forwarded,) = [
        (decode(WorkItem, value), headers)
        for (topic, _, value), headers in zip(recorder.sent, recorder.headers, strict=True)
        if topic == "tokenbus.worker.w"
    ]
    (traceparent,) = [v.decode() for k, v in forwarded[1] if k == "traceparent"]
    assert traceparent.split("-")[1:3] == [trace_id, queued["span_id"]]
    assert path_ns(forwarded[1]) == queued["end_ns"]  # the worker's hop starts there


async def test_a_refused_request_ends_its_span_with_the_outcome(tmp_path: Path) -> None:
    recorder = Recorder()
    dispatcher, tracing = traced_dispatcher(tmp_path, recorder)
    loop = asyncio.create_task(dispatcher.run())
    outcome = await dispatcher.handle_request(
        Record("p", 0, 0, b"t", encode(request(2)), service_headers("t"))
    )  # no worker
    loop.cancel()
    assert outcome is Outcome.REFUSED
    assert tracing.buffer is not None
    spans = taken_spans(tracing.buffer)["t"]
    assert [s["name"] for s in spans] == ["job.admit"]
    assert spans[0]["attributes"]["tokenbus.outcome"] == "admitted"  # refused in the queue


async def test_an_unproven_request_files_its_span_under_no_tenant(tmp_path: Path) -> None:
    recorder = Recorder()
    dispatcher, tracing = traced_dispatcher(tmp_path, recorder)
    forged = [("authorization", b"Bearer forged")]
    outcome = await dispatcher.handle_request(Record("p", 0, 0, b"t", encode(request(3)), forged))
    assert outcome is Outcome.REFUSED
    assert tracing.buffer is not None
    by_tenant = tracing.buffer.take()
    assert list(by_tenant) == [NO_TENANT]
    (span,) = by_tenant[NO_TENANT]
    assert span["attributes"] == {"tokenbus.outcome": "refused"}
