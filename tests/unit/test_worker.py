"""The worker loop (workers.worker) against bench's pretend engine and a recording
producer: what one request makes on the reply and usage topics, and how it ends."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from aiokafka.errors import KafkaTimeoutError, UnknownTopicOrPartitionError
from opentelemetry.trace import Span

from bench.fake_engine import FakeEngine
from schemas import (
    FinishReason,
    SamplingParams,
    UsageEvent,
    UsageStatus,
    WorkItem,
    decode,
    encode,
)
from tests.unit.fakes import SpanRow, taken_spans
from tokenbus.chunks import Chunk, decode_batch
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.retry import Backoff
from tokenbus.tracing import Tracing, inject, with_path
from workers import worker as worker_module
from workers.interface import EngineDelta, EngineTimings, GenerateParams
from workers.replies import ReplyBatcher
from workers.worker import (
    ENGINE_PHASES,
    PATH_PHASES,
    Worker,
    finish_of,
    ids_digest,
    path_edges,
)

REPLY_TO = "tokenbus.replies.acme.c1"


class Sent:
    """A broker that acknowledges at once: an offset per topic."""

    def __init__(self, offset: int) -> None:
        self.offset = offset


class RecordingProducer:
    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes]] = []
        self.headers: list[list[tuple[str, bytes]]] = []

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future[Any]:
        self.records.append((topic, key, value))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(Sent(len(self.records)))
        return done

    async def send_and_wait(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> Sent:
        self.records.append((topic, key, value))
        self.headers.append(list(headers or []))
        return Sent(len(self.records))

    def on(self, topic: str) -> list[bytes]:
        return [value for t, _, value in self.records if t == topic]


class ScriptedEngine(FakeEngine):
    """The pretend engine, ending each request with a finish reason of the test's choice
    (or raising, or ending with none)."""

    def __init__(self, finish: str | Exception | None) -> None:
        super().__init__("tiny", max_num_seqs=4)
        self._finish = finish

    async def deltas(
        self, request_id: str, prompt: str | list[int], params: GenerateParams
    ) -> AsyncIterator[EngineDelta]:
        yield EngineDelta(" a", [5], None, num_prompt_tokens=3, num_cached_tokens=0)
        if isinstance(self._finish, Exception):
            raise self._finish
        yield EngineDelta(" b", [6], self._finish)


def work_item(max_tokens: int = 4, **fields: Any) -> WorkItem:
    now = datetime.now(UTC)
    base: dict[str, Any] = dict(
        request_id="r1",
        session_id="sess_1",
        tenant_id="acme",
        model="tiny",
        prompt="hello there",
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        reply_to=REPLY_TO,
        created_at=now,
        admitted_at=now,
        dispatched_at=now,
        cache_salt="acme",
    )
    return WorkItem(**(base | fields))


async def serve(
    tmp_path: Path, engine: FakeEngine, item: WorkItem
) -> tuple[Worker, RecordingProducer, list[Chunk], list[UsageEvent]]:
    worker = Worker(Settings(home=tmp_path, worker_id="w1"), engine)
    producer = RecordingProducer()
    worker._producer = producer
    worker._replies = ReplyBatcher(producer)
    await engine.start()
    await worker._serve(item)
    await worker._replies.drain()
    topics = worker._topics
    chunks = [c for raw in producer.on(REPLY_TO) for c in decode_batch(raw).chunks]
    usage = [decode(UsageEvent, raw) for raw in producer.on(topics.usage)]
    return worker, producer, chunks, usage


async def test_a_request_streams_its_tokens_in_order_and_reports_once(tmp_path: Path) -> None:
    _, _, chunks, usage = await serve(tmp_path, FakeEngine("tiny", 4), work_item(max_tokens=5))
    assert [c.seq for c in chunks] == [0, 1, 2, 3, 4]
    assert sum(c.num_tokens for c in chunks) == 5
    assert [c.finish_reason for c in chunks] == [None] * 4 + [FinishReason.LENGTH]
    assert chunks[-1].num_prompt_tokens == 6  # 11 characters at 1.8 a token
    (event,) = usage
    assert event.status is UsageStatus.OK and event.num_completion_tokens == 5
    assert event.num_prompt_tokens == 6 and event.last_seq == 4
    assert event.worker_id == "w1" and event.error_code is None


async def test_a_resumed_attempt_continues_the_stream_and_bills_the_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    item = work_item(max_tokens=5, attempt=1, resume_token_ids=[7, 7], resume_seq=2)
    with caplog.at_level(logging.INFO, logger="workers.worker"):
        _, _, chunks, usage = await serve(tmp_path, FakeEngine("tiny", 4), item)
    prompt_ids = FakeEngine("tiny", 4).tokenize("hello there")
    (line,) = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    assert f"11 prompt ids ({ids_digest(prompt_ids)})" in line
    assert f"2 delivered ids ({ids_digest([7, 7])})" in line
    assert "[" not in line and ", ".join(map(str, prompt_ids)) not in line  # no ids
    assert [c.seq for c in chunks] == [2, 3, 4]  # after the 2 chunks delivered before
    (event,) = usage
    assert event.num_completion_tokens == 5 and event.last_seq == 4 and event.attempt == 1


@pytest.mark.parametrize(
    ("engine_reason", "expected"),
    [("stop", FinishReason.STOP), ("length", FinishReason.LENGTH), ("abort", FinishReason.ABORT)],
)
async def test_known_finish_reasons_end_the_stream_as_they_are(
    tmp_path: Path, engine_reason: str, expected: FinishReason
) -> None:
    _, _, chunks, usage = await serve(tmp_path, ScriptedEngine(engine_reason), work_item())
    assert chunks[-1].finish_reason is expected and chunks[-1].error is None
    assert usage[0].error_code is None


@pytest.mark.parametrize("engine_reason", ["error", "repetition"])
async def test_an_engine_error_or_an_unknown_reason_ends_as_an_error_never_a_stop(
    tmp_path: Path, engine_reason: str
) -> None:
    _, _, chunks, usage = await serve(tmp_path, ScriptedEngine(engine_reason), work_item())
    assert [c.seq for c in chunks] == [0, 1]  # one last chunk, not a second error chunk
    last = chunks[-1]
    assert last.finish_reason is FinishReason.ERROR
    assert last.error is not None and last.error.code == "engine_error"
    if engine_reason != "error":
        assert repr(engine_reason) in last.error.message
    (event,) = usage
    assert event.status is UsageStatus.FAILED and event.error_code == "engine_error"
    assert event.num_completion_tokens == 2


async def test_an_engine_that_raises_or_stops_short_still_ends_the_stream(
    tmp_path: Path,
) -> None:
    cases: list[tuple[Exception | None, str, list[int]]] = [
        (RuntimeError("boom"), "RuntimeError: boom", [0, 1]),  # " a", then the error
        (None, "early", [0, 1, 2]),  # " a", " b" with no reason, then the error
    ]
    for finish, message, seqs in cases:
        _, _, chunks, usage = await serve(tmp_path, ScriptedEngine(finish), work_item())
        last = chunks[-1]
        assert last.finish_reason is FinishReason.ERROR and last.error is not None
        assert message in last.error.message
        assert [c.seq for c in chunks] == seqs
        assert usage[0].error_code == "engine_error"


async def test_a_request_cancelled_before_it_runs_never_reaches_the_engine(
    tmp_path: Path,
) -> None:
    engine = ScriptedEngine(RuntimeError("the engine must not be called"))
    worker = Worker(Settings(home=tmp_path, worker_id="w1"), engine)
    worker._cancels.note("acme", "r1", time.monotonic(), attempt=None, reason="client_disconnected")
    producer = RecordingProducer()
    worker._producer = producer
    worker._replies = ReplyBatcher(producer)
    await worker._serve(work_item())
    await worker._replies.drain()
    (chunk,) = [c for raw in producer.on(REPLY_TO) for c in decode_batch(raw).chunks]
    assert chunk.finish_reason is FinishReason.ABORT and chunk.num_tokens == 0
    (event,) = [decode(UsageEvent, raw) for raw in producer.on(worker._topics.usage)]
    assert event.status is UsageStatus.CANCELLED and event.num_completion_tokens == 0


class CancelledMidway(FakeEngine):
    """Two tokens, then the client's cancel reaches the worker while a step is in flight:
    that step's token comes, then the abort."""

    def __init__(self) -> None:
        super().__init__("tiny", max_num_seqs=4)
        self.worker: Worker | None = None

    async def deltas(
        self, request_id: str, prompt: str | list[int], params: GenerateParams
    ) -> AsyncIterator[EngineDelta]:
        yield EngineDelta(" a", [5], None, num_prompt_tokens=3, num_cached_tokens=0)
        yield EngineDelta(" b", [6], None)
        assert self.worker is not None
        self.worker._cancels.note("acme", "r1", time.monotonic(), reason="client_disconnected")
        yield EngineDelta(" c", [7], None)
        yield EngineDelta("", [], "abort")


async def test_a_cancelled_request_counts_the_tokens_it_made_after_the_cancel(
    tmp_path: Path,
) -> None:
    engine = CancelledMidway()
    worker = Worker(Settings(home=tmp_path, worker_id="w1"), engine)
    engine.worker = worker
    producer = RecordingProducer()
    worker._producer = producer
    worker._replies = ReplyBatcher(producer)
    await engine.start()
    await worker._serve(work_item(max_tokens=100))
    await worker._replies.drain()
    chunks = [c for raw in producer.on(REPLY_TO) for c in decode_batch(raw).chunks]
    assert chunks[-1].finish_reason is FinishReason.ABORT
    assert sum(c.num_tokens for c in chunks) == 3
    labels = {"tenant": "acme", "model": "tiny", "priority": "1", "worker": "w1"}
    sample = worker.metrics.registry.get_sample_value
    assert sample("tokenbus_worker_tokens_after_cancel_count", labels) == 1
    assert sample("tokenbus_worker_tokens_after_cancel_sum", labels) == 1  # " c"


async def test_a_record_that_is_not_a_work_item_is_dead_lettered_with_its_reason(
    tmp_path: Path,
) -> None:
    worker = Worker(Settings(home=tmp_path, worker_id="w1"), FakeEngine("tiny", 4))
    producer = RecordingProducer()
    worker._producer = producer
    worker._replies = ReplyBatcher(producer)
    for value in (b"{not json", work_item(reply_to="tokenbus.usage").model_dump_json().encode()):
        record: ConsumerRecord[bytes, bytes] = ConsumerRecord(
            worker.request_topic, 0, 9, 0, 0, b"acme", value, None, len(b"acme"), len(value), []
        )
        await worker._slots.acquire()  # _handle releases the slot it was given
        await worker._handle(record)
    dead = producer.on(worker._topics.dead_letters)
    assert len(dead) == 2
    assert b"not a reply topic" in dead[1]
    assert producer.on(worker._topics.usage) == [] and producer.on(REPLY_TO) == []


def test_finish_of_maps_every_reason() -> None:
    assert finish_of(None) == (None, None)
    assert finish_of("stop") == (FinishReason.STOP, None)
    reason, error = finish_of("something-new")
    assert reason is FinishReason.ERROR and error is not None
    assert "'something-new'" in error.message


class TimedEngine(ScriptedEngine):
    """Ends each request with the engine's own times, as vLLM's stats give them: its
    front end takes it as the worker hands it over, its core queues it 2 ms later, its
    first token 2 ms before it reaches the worker. ``arrival=False``: an engine that
    does not say when its front end took it."""

    def __init__(self, finish: str, *, arrival: bool = True) -> None:
        super().__init__(finish)
        self.arrival = arrival

    async def deltas(
        self, request_id: str, prompt: str | list[int], params: GenerateParams
    ) -> AsyncIterator[EngineDelta]:
        start, arrival = time.monotonic(), time.time()
        await asyncio.sleep(0.020)
        yield EngineDelta(" a", [5], None, num_prompt_tokens=3, num_cached_tokens=1)
        timings = EngineTimings(
            start + 0.002,
            start + 0.010,
            start + 0.018,
            start + 0.028,
            arrival=arrival if self.arrival else None,
        )
        yield EngineDelta(" b", [6], "stop", timings=timings)


async def handle_traced(
    tmp_path: Path, engine: FakeEngine, sent_ns: int
) -> tuple[dict[str, SpanRow], RecordingProducer, Span]:
    """One request through the worker's handler, its record sent at ``sent_ns`` under a
    job's ``job.dispatch`` span: the worker's spans by name, its producer, that span."""
    worker = Worker(Settings(home=tmp_path, worker_id="w1"), engine)
    producer = RecordingProducer()
    worker._producer = producer
    worker._replies = ReplyBatcher(producer)
    headers: list[tuple[str, bytes]] = []
    with Tracing(Settings(), "job").tracer.start_as_current_span("job.dispatch") as dispatch:
        inject(headers, with_path(sent_ns))
    record = ConsumerRecord(
        "tokenbus.worker.w1", 0, 7, 0, 0, b"acme", encode(work_item(attempt=1)), None, 0, 0,
        headers,
    )  # fmt: skip
    await worker._slots.acquire()
    await worker._handle(record)
    await worker._replies.drain()
    assert worker._tracing.buffer is not None
    spans = {s["name"]: s for s in taken_spans(worker._tracing.buffer)["acme"]}
    return spans, producer, dispatch


async def test_a_request_is_traced_under_its_records_context_with_the_engines_phases(
    tmp_path: Path,
) -> None:
    sent_ns = time.time_ns() - 3_000_000  # the job sent it 3 ms before the worker took it
    spans, producer, dispatch = await handle_traced(tmp_path, TimedEngine("stop"), sent_ns)
    request = spans["worker.request"]
    assert request["trace_id"] == f"{dispatch.get_span_context().trace_id:032x}"
    assert request["parent_span_id"] == f"{dispatch.get_span_context().span_id:016x}"
    assert request["attributes"] == {
        "tokenbus.tenant": "acme",
        "tokenbus.request_id": "r1",
        "tokenbus.session_id": "sess_1",
        "tokenbus.attempt": 1,
        "tokenbus.priority": 1,
        "tokenbus.model": "tiny",
        "tokenbus.worker": "w1",
        "tokenbus.num_prompt_tokens": 3,
        "tokenbus.num_completion_tokens": 2,
        "tokenbus.num_cached_tokens": 1,
    }
    phases = [spans[name] for name in ENGINE_PHASES]
    assert all(p["parent_span_id"] == request["span_id"] for p in phases)
    durations_ms = [(int(p["end_ns"]) - int(p["start_ns"])) / 1e6 for p in phases]
    assert [round(d) for d in durations_ms] == [8, 8, 10]
    assert int(phases[0]["start_ns"]) >= int(request["start_ns"])
    # The path to the first token through the worker: from the bus's hop, whose end is
    # the request's start, the phases tile up to the first reply record's send.
    hop = spans["bus.dispatch"]
    assert hop["parent_span_id"] == request["parent_span_id"]
    assert int(hop["start_ns"]) == sent_ns and hop["end_ns"] == request["start_ns"]
    path = [spans[name] for name in PATH_PHASES]
    assert path[0]["start_ns"] == request["start_ns"]
    assert all(a["end_ns"] == b["start_ns"] for a, b in itertools.pairwise(path))
    assert spans["worker.prefill"]["end_ns"] == spans["worker.decode"]["start_ns"]
    assert int(path[-1]["end_ns"]) >= int(spans["worker.prefill"]["end_ns"])
    # The engine's input processing, from its front end's arrival to its core's queue.
    engine_input = spans["worker.engine_input"]
    assert round((int(engine_input["end_ns"]) - int(engine_input["start_ns"])) / 1e6) == 2
    # The usage record carries the request's span: billing's row joins the trace.
    (usage_headers,) = [h for h in producer.headers if h]
    (traceparent,) = [v.decode() for k, v in usage_headers if k == "traceparent"]
    assert traceparent.split("-")[1:3] == [request["trace_id"], request["span_id"]]


async def test_an_engine_without_an_arrival_leaves_its_input_processing_in_the_intake(
    tmp_path: Path,
) -> None:
    engine = TimedEngine("stop", arrival=False)
    spans, _, _ = await handle_traced(tmp_path, engine, time.time_ns())
    intake, engine_input = spans["worker.intake"], spans["worker.engine_input"]
    assert engine_input["start_ns"] == engine_input["end_ns"] == intake["end_ns"]
    # The intake holds the 2 ms to the engine's queue.
    assert (int(intake["end_ns"]) - int(intake["start_ns"])) / 1e6 >= 2
    path = [spans[name] for name in PATH_PHASES]
    assert all(a["end_ns"] == b["start_ns"] for a, b in itertools.pairwise(path))


async def test_a_request_ends_in_the_metrics_with_its_ttft_and_mean_gap(tmp_path: Path) -> None:
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from tokenbus.metrics import metrics_app

    worker, _, _, _ = await serve(tmp_path, FakeEngine("tiny", 4), work_item(max_tokens=5))
    app = metrics_app(worker.metrics.registry, lambda: {"status": "ok"})
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/metrics")
        text = await response.text()
        health = await (await client.get("/healthz")).json()

    got = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = frozenset({("tenant", "acme"), ("model", "tiny"), ("priority", "1"), ("worker", "w1")})
    assert got[("tokenbus_worker_requests_total", labels | {("finish", "length")})] == 1
    assert got[("tokenbus_worker_tokens_generated_total", labels)] == 5
    assert got[("tokenbus_worker_ttft_seconds_count", labels)] == 1
    assert got[("tokenbus_worker_itl_seconds_count", labels)] == 1
    engine = frozenset({("model", "tiny"), ("worker", "w1")})
    assert got[("tokenbus_worker_max_num_seqs", engine)] == 4
    assert ("tokenbus_worker_kv_cache_usage", engine) in got
    assert health == {"status": "ok"}


def test_the_workers_path_edges_stay_between_its_take_and_its_first_send() -> None:
    # In order: the engine's stamps as they are.
    assert path_edges(100, [110, 120, 130], 140) == [100, 110, 120, 130, 140]
    # A stamp before the take, or after the send (a clock step between processes):
    # held at the neighbour, so the phases still tile 100..140 with none negative.
    assert path_edges(100, [90, 150, 130], 140) == [100, 100, 140, 140, 140]
    assert path_edges(100, [110, 105, 130], 140) == [100, 110, 110, 130, 140]
    # With the engine's arrival first, as the worker passes it.
    assert path_edges(100, [104, 110, 120, 130], 140) == [100, 104, 110, 120, 130, 140]


class GatedEngine(ScriptedEngine):
    """Each request's last token waits for the test to open its gate."""

    def __init__(self) -> None:
        super().__init__("stop")
        self.gates: dict[str, asyncio.Event] = {}
        self.both_running = asyncio.Event()

    async def deltas(
        self, request_id: str, prompt: str | list[int], params: GenerateParams
    ) -> AsyncIterator[EngineDelta]:
        yield EngineDelta(" a", [5], None, num_prompt_tokens=3, num_cached_tokens=0)
        gate = self.gates.setdefault(str(prompt), asyncio.Event())
        if len(self.gates) == 2:
            self.both_running.set()
        await gate.wait()
        yield EngineDelta(" b", [6], "stop")


class LetGo:
    """What the worker tells its producer's topic tracking (tokenbus.metadata)."""

    def __init__(self) -> None:
        self.topics: list[str] = []

    def let_go(self, topic: str) -> None:
        self.topics.append(topic)


async def test_a_reply_topic_is_let_go_once_its_last_running_request_ends(
    tmp_path: Path,
) -> None:
    engine = GatedEngine()
    worker = Worker(Settings(home=tmp_path, worker_id="w1"), engine)
    producer = RecordingProducer()
    worker._producer = producer
    worker._replies = ReplyBatcher(producer)
    tracking = LetGo()
    worker._producer_topics = tracking  # type: ignore[assignment]
    await engine.start()

    def record(request_id: str, prompt: str) -> ConsumerRecord[bytes, bytes]:
        value = encode(work_item(request_id=request_id, prompt=prompt))
        return ConsumerRecord(worker.request_topic, 0, 1, 0, 0, b"acme", value, None, 0, 0, [])

    handled = []
    for request_id, prompt in (("r1", "first"), ("r2", "second")):
        await worker._slots.acquire()
        handled.append(asyncio.create_task(worker._handle(record(request_id, prompt))))
    await asyncio.wait_for(engine.both_running.wait(), 5)
    engine.gates["first"].set()
    await handled[0]
    assert tracking.topics == []  # the second one still answers there
    engine.gates["second"].set()
    await handled[1]
    assert tracking.topics == [REPLY_TO]
    assert worker._replying == {}


async def test_the_workers_aborts_poll_at_the_background_wait_its_requests_at_the_short_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No first token waits on an abort: on the bundled broker its consumer, idle nearly
    always, polls at the background wait, the worker's request topic at the short one."""
    settings = Settings(home=tmp_path, worker_id="w1", broker_profile="tansu")
    waits: list[int] = []

    class Made(Exception):
        pass

    def made(*args: Any, **kwargs: Any) -> Any:
        waits.append(make_consumer(*args, **kwargs)._fetch_max_wait_ms)
        raise Made

    monkeypatch.setattr(worker_module, "make_consumer", made)
    worker = Worker(settings, FakeEngine("tiny", max_num_seqs=4))
    for follow in (worker._follow_cancels, worker._follow_requests):
        with pytest.raises(Made):
            await follow()
    assert waits == [settings.background_fetch_wait_ms, settings.consumer_fetch_wait_ms]
    assert waits == [100, 20]


async def worker_on(tmp_path: Path, producer: RecordingProducer) -> Worker:
    """A worker on the pretend engine, started, that sends through ``producer``."""
    worker = Worker(Settings(home=tmp_path, worker_id="w1"), FakeEngine("tiny", 4))
    worker._producer = producer
    worker._replies = ReplyBatcher(producer)
    await worker._engine.start()
    return worker


class GoneReplyTopic(RecordingProducer):
    """A broker that refuses every record for the reply topic (its client deleted it, on a
    broker that does not make topics on demand), and takes the rest."""

    async def send(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future[Any]:
        if topic != REPLY_TO:
            return await super().send(topic, value, key, headers)
        refused: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        refused.set_exception(UnknownTopicOrPartitionError(topic))
        return refused


@pytest.mark.parametrize("cancelled", [False, True], ids=["served", "cancelled before it ran"])
async def test_a_request_whose_chunks_cannot_be_delivered_is_still_reported_once(
    tmp_path: Path, cancelled: bool
) -> None:
    # The engine did the work: it is billed, and the job frees its seat on this event.
    producer = GoneReplyTopic()
    worker = await worker_on(tmp_path, producer)
    if cancelled:
        worker._cancels.note("acme", "r1", time.monotonic(), attempt=None, reason="gone")
    await worker._serve(work_item(max_tokens=5))
    (event,) = [decode(UsageEvent, raw) for raw in producer.on(worker._topics.usage)]
    if cancelled:
        assert event.status is UsageStatus.CANCELLED and event.num_completion_tokens == 0
    else:
        assert event.status is UsageStatus.FAILED and event.error_code == "reply_undeliverable"
        assert (event.num_prompt_tokens, event.num_completion_tokens) == (6, 5)


class UsageRefusedTwice(RecordingProducer):
    """A broker that refuses the first two UsageEvents sent to it, as while it fails over."""

    def __init__(self) -> None:
        super().__init__()
        self.num_refused = 0

    async def send_and_wait(
        self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> Sent:
        if topic.endswith(".usage") and self.num_refused < 2:
            self.num_refused += 1
            raise KafkaTimeoutError()
        return await super().send_and_wait(topic, value, key, headers)


async def test_a_usage_event_the_broker_refuses_is_sent_again_until_it_takes_it(
    tmp_path: Path,
) -> None:
    # The job frees the request's seat, and billing charges it, on this event alone.
    producer = UsageRefusedTwice()
    worker = await worker_on(tmp_path, producer)
    worker._backoff = Backoff(initial_s=0.01)
    await worker._serve(work_item(max_tokens=3))
    (event,) = [decode(UsageEvent, raw) for raw in producer.on(worker._topics.usage)]
    assert producer.num_refused == 2 and event.num_completion_tokens == 3
