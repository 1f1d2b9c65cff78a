"""The dispatcher's decisions, with an in-memory window store and a recording publisher."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka.errors import KafkaError
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from schemas.codec import decode, encode
from schemas.fleet import WorkerStatus
from schemas.messages import REASSIGNED, CancelRequest, InferenceRequest, SamplingParams, WorkItem
from schemas.replies import FinishReason, TokenChunk, TokenChunkBatch
from schemas.usage import UsageEvent, UsageStatus
from stream_jobs.dispatcher import STALL_WARN_S, Dispatcher, Outcome, Record
from stream_jobs.ledger import Entry, State
from stream_jobs.metrics import job_registry
from tests.unit.fakes import (
    TOPICS,
    Forwards,
    ManualClock,
    MemoryLedger,
    Recorder,
    cancel,
    memory_dispatcher,
    reply_topic,
    service_headers,
)
from tokenbus.clock import SYSTEM_CLOCK, Clock
from tokenbus.config import Settings

REPLIES = reply_topic("t")


def request(n: int, tenant: str = "t", priority: int = 1, max_tokens: int = 10) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"r{n}",
        session_id="s",
        tenant_id=tenant,
        priority=priority,
        model="m",
        prompt="hello",
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_to=reply_topic(tenant),
    )


def dispatcher_for(
    settings: Settings,
    recorder: Recorder,
    clock: Clock = SYSTEM_CLOCK,
    ledger: MemoryLedger | None = None,
) -> Dispatcher:
    """One run of the job: its memory is its own; the topics (``recorder``) and, when
    given, the ledger are shared with other runs."""
    return memory_dispatcher(
        settings, recorder, ledger=ledger, clock=clock, forwards=Forwards(recorder)
    )


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def dispatcher(recorder: Recorder, clock: ManualClock, tmp_path: Path) -> Dispatcher:
    settings = Settings(
        home=tmp_path,
        tenant_tpm={"small": 40},
        default_priority_class=0,
        worker_dead_after_s=0.3,
        vip_reserve=0.1,
    )
    return dispatcher_for(settings, recorder, clock)


def heartbeat(
    capacity: int = 2,
    worker_id: str = "w",
    incarnation: str = "run-1",
    running: int = 0,
    sent_at: datetime | None = None,
) -> bytes:
    status = WorkerStatus(
        worker_id=worker_id,
        model="m",
        request_topic=f"tokenbus.worker.{worker_id}",
        max_num_seqs=capacity,
        num_running=running,
        incarnation=incarnation,
    )
    return encode(status.model_copy(update={"sent_at": sent_at}) if sent_at else status)


async def admit(dispatcher: Dispatcher, req: InferenceRequest) -> asyncio.Task[Outcome]:
    tenant = req.tenant_id
    assert tenant is not None
    task = asyncio.create_task(
        dispatcher.handle_request(
            Record("p", 0, 0, tenant.encode(), encode(req), service_headers(tenant))
        )
    )
    await asyncio.sleep(0)
    return task


async def test_forwards_to_a_live_worker_and_refuses_without_one(
    dispatcher: Dispatcher, recorder: Recorder, clock: ManualClock
) -> None:
    clock.advance(0.3)  # past the start-up wait for heartbeats (worker_dead_after_s)
    loop = asyncio.create_task(dispatcher.run())
    assert await (await admit(dispatcher, request(1))) is Outcome.REFUSED
    (chunk,) = recorder.chunks_on(REPLIES)
    assert chunk.error is not None and chunk.error.code == "no_worker"

    dispatcher.observe_heartbeat(heartbeat())
    assert await (await admit(dispatcher, request(2))) is Outcome.FORWARDED
    (forwarded,) = [decode(WorkItem, v) for v in recorder.on("tokenbus.worker.w")]
    assert forwarded.worker_id == "w" and forwarded.request_id == "r2"
    loop.cancel()


def usage_of(n: int) -> bytes:
    return encode(
        UsageEvent(
            request_id=f"r{n}",
            session_id="s",
            tenant_id="t",
            model="m",
            status=UsageStatus.OK,
            num_prompt_tokens=2,
            num_completion_tokens=10,
            created_at=datetime.now(UTC),
        )
    )


async def test_waits_when_saturated_but_class_zero_has_reserved_seats(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=10))
    loop = asyncio.create_task(dispatcher.run())
    for n in range(9):  # 10 seats, 10% held back for class 0: classes 1 and 2 get 9
        assert await (await admit(dispatcher, request(n))) is Outcome.FORWARDED
    standard = await admit(dispatcher, request(10, priority=1))
    await asyncio.sleep(0.1)
    assert not standard.done()  # nine in flight fill the seats of class 1: it waits
    vip = await admit(dispatcher, request(11, priority=0))
    assert await asyncio.wait_for(vip, 1) is Outcome.FORWARDED  # the reserved seat
    second_vip = await admit(dispatcher, request(12, priority=0))
    await asyncio.sleep(0.1)
    assert not second_vip.done()  # every seat is taken, even for class 0

    def finish(n: int) -> None:
        dispatcher.observe_heartbeat(heartbeat(capacity=10))  # the worker stays live
        dispatcher.observe_usage(usage_of(n))

    finish(0)
    assert await asyncio.wait_for(second_vip, 1) is Outcome.FORWARDED  # class 0 goes first
    await asyncio.sleep(0.1)
    assert not standard.done()  # ten in flight: still above the nine seats of class 1
    finish(1)
    await asyncio.sleep(0.1)
    assert not standard.done()
    finish(2)
    assert await asyncio.wait_for(standard, 1) is Outcome.FORWARDED
    order = [decode(WorkItem, v).request_id for v in recorder.on("tokenbus.worker.w")]
    assert order == [f"r{n}" for n in range(9)] + ["r11", "r12", "r10"]
    loop.cancel()


async def test_over_quota_is_refused_with_retry_after(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat())
    loop = asyncio.create_task(dispatcher.run())
    assert (
        await (await admit(dispatcher, request(1, tenant="small", max_tokens=30)))
        is Outcome.FORWARDED
    )
    assert (
        await (await admit(dispatcher, request(2, tenant="small", max_tokens=30)))
        is Outcome.REFUSED
    )
    chunk = recorder.chunks_on(reply_topic("small"))[-1]
    assert chunk.error is not None and chunk.error.code == "quota_exceeded"
    assert chunk.error.retry_after_s is not None and 59 < chunk.error.retry_after_s <= 60
    assert (chunk.error.limit_kind, chunk.error.num_limit) == ("tokens", 40)
    assert chunk.error.num_remaining == 4  # 36 of 40 held by r1 (30 + its prompt)
    usage = decode(UsageEvent, recorder.on(TOPICS.usage)[-1])
    assert usage.status == "rejected" and usage.tenant_id == "small"
    loop.cancel()


class SlowLedger(MemoryLedger):
    """A ledger whose durable writes the broker acknowledges only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.acknowledged = asyncio.Event()

    async def put_durably(
        self, home: int | None, tenant_id: str, request_id: str, entry: Entry
    ) -> None:
        await self.acknowledged.wait()
        await super().put_durably(home, tenant_id, request_id, entry)


class GatedRecorder(Recorder):
    """The topics, with the broker's acknowledgement of each forward held until told."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards_acknowledged = asyncio.Event()

    async def __call__(self, topic: str, key: bytes, value: bytes, headers: Any = None) -> Any:
        if topic == "tokenbus.worker.w":
            await self.forwards_acknowledged.wait()
        return await super().__call__(topic, key, value, headers)


async def test_a_copy_taken_before_the_forward_is_acknowledged_leaves_it_to_run_again(
    clock: ManualClock, tmp_path: Path
) -> None:
    # Picked and sent, the broker's acknowledgement not in: the ledger holds nothing of
    # it yet. A copy counted now must be written ADMITTED, not FORWARDED: a job killed
    # before the acknowledgement has the request redelivered, and must run it.
    settings = Settings(home=tmp_path, worker_dead_after_s=0.3)
    recorder, ledger = GatedRecorder(), MemoryLedger()
    dispatcher = dispatcher_for(settings, recorder, clock, ledger)
    dispatcher.observe_heartbeat(heartbeat())
    loop = asyncio.create_task(dispatcher.run())
    handled = await admit(dispatcher, request(1))
    await asyncio.sleep(0.05)
    assert ("t", "r1") in dispatcher._in_flight and ledger.get("t", "r1") is None
    assert await (await admit(dispatcher, request(1))) is Outcome.DUPLICATE
    entry = ledger.get("t", "r1")
    assert entry is not None and (entry.state, entry.copies) == (State.ADMITTED, 1)

    # Killed here, its request redelivered to a new job: it runs.
    again = dispatcher_for(settings, recorder, clock, ledger)
    again.observe_heartbeat(heartbeat())
    again_loop = asyncio.create_task(again.run())
    redelivered = await admit(again, request(1))
    recorder.forwards_acknowledged.set()
    assert await redelivered is Outcome.FORWARDED
    entry = ledger.get("t", "r1")
    assert entry is not None and (entry.state, entry.copies) == (State.FORWARDED, 1)
    assert await handled is Outcome.FORWARDED  # (the first job's own send, let through)
    loop.cancel()
    again_loop.cancel()


@pytest.mark.parametrize("refusal", ["quota_exceeded", "no_worker"])
async def test_a_refusal_goes_out_only_once_the_ledger_holds_it(
    refusal: str, recorder: Recorder, clock: ManualClock, tmp_path: Path
) -> None:
    # A refusal invites a retry under a new id (a batch line's next one). Were it seen
    # before the ledger's entry reached the broker, a job killed in between would take
    # the id's redelivered request as new and run it beside its retry.
    settings = Settings(home=tmp_path, tenant_tpm={"small": 40}, worker_dead_after_s=0.3)
    ledger = SlowLedger()
    dispatcher = dispatcher_for(settings, recorder, clock, ledger)
    clock.advance(0.3)  # past the start-up wait for heartbeats
    if refusal == "quota_exceeded":
        dispatcher.observe_heartbeat(heartbeat())
    loop = asyncio.create_task(dispatcher.run())
    # More than the tenant's minute, or within it with no worker alive.
    refused = request(1, tenant="small", max_tokens=50 if refusal == "quota_exceeded" else 10)
    handled = await admit(dispatcher, refused)
    await asyncio.sleep(0.05)
    assert recorder.chunks_on(reply_topic("small")) == []  # not while the broker has not got it
    ledger.acknowledged.set()
    assert await handled is Outcome.REFUSED
    (chunk,) = recorder.chunks_on(reply_topic("small"))
    assert chunk.error is not None and chunk.error.code == refusal
    entry = ledger.get("small", "r1")
    assert entry is not None and entry.state is State.DONE
    loop.cancel()

    # The job killed after the refusal went out, its request redelivered: a duplicate.
    again = dispatcher_for(settings, recorder, clock, ledger)
    again.observe_heartbeat(heartbeat())
    assert await (await admit(again, refused)) is Outcome.DUPLICATE
    assert recorder.on("tokenbus.worker.w") == []


async def test_over_the_request_rate_is_refused_naming_requests(
    recorder: Recorder, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path, default_rpm=2, default_priority_class=0)
    dispatcher = dispatcher_for(settings, recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=10))
    loop = asyncio.create_task(dispatcher.run())
    outcomes = [await (await admit(dispatcher, request(n, max_tokens=1))) for n in range(3)]
    assert outcomes == [Outcome.FORWARDED, Outcome.FORWARDED, Outcome.REFUSED]
    error = recorder.chunks_on(REPLIES)[-1].error
    assert error is not None and error.code == "quota_exceeded"
    assert (error.limit_kind, error.num_limit, error.num_remaining) == ("requests", 2, 0)
    assert error.retry_after_s is not None and 59 < error.retry_after_s <= 60
    loop.cancel()


class FailingReplies(Recorder):
    """A publisher whose next send to a reply topic fails, as a broker's refusal would."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = False

    async def __call__(self, topic: str, key: bytes, value: bytes, headers: Any = None) -> Any:
        if self.fail_next and topic == REPLIES:
            self.fail_next = False
            raise KafkaError("the broker refused the record")
        return await super().__call__(topic, key, value, headers)


async def test_a_cancel_whose_answer_is_not_sent_leaves_its_request_waiting(
    clock: ManualClock, tmp_path: Path
) -> None:
    recorder = FailingReplies()
    settings = Settings(home=tmp_path, default_priority_class=0, vip_reserve=0.1)
    dispatcher = dispatcher_for(settings, recorder, clock)
    dispatcher.observe_heartbeat(heartbeat(capacity=1))
    loop = asyncio.create_task(dispatcher.run())
    try:
        assert await (await admit(dispatcher, request(1))) is Outcome.FORWARDED
        waiting = await admit(dispatcher, request(2))
        recorder.fail_next = True
        with pytest.raises(KafkaError):
            await cancel(dispatcher, "t", "r2")
        # Neither served nor told would be lost: it waits again, as it was.
        assert ("t", "r2") in dispatcher._waiting and not waiting.done()
        assert dispatcher.metrics.num_cancelled_waiting == 0
        await cancel(dispatcher, "t", "r2")  # sent again, it is cancelled
        assert await asyncio.wait_for(waiting, 1) is Outcome.CANCELLED
        error = recorder.chunks_on(REPLIES)[-1].error
        assert error is not None and error.code == "cancelled"
    finally:
        loop.cancel()


async def test_a_cancelled_waiting_request_never_runs_and_is_refunded(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=1))
    loop = asyncio.create_task(dispatcher.run())
    assert (
        await (await admit(dispatcher, request(1, tenant="small", max_tokens=10)))
        is Outcome.FORWARDED
    )
    waiting = await admit(dispatcher, request(2, tenant="small", max_tokens=10))
    await cancel(dispatcher, "small", "r2")
    assert await waiting is Outcome.CANCELLED
    assert [decode(WorkItem, v).request_id for v in recorder.on("tokenbus.worker.w")] == ["r1"]
    # Refunded: another request of the same size fits in the 40-token window again.
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    assert (
        await (await admit(dispatcher, request(3, tenant="small", max_tokens=10)))
        is Outcome.FORWARDED
    )
    loop.cancel()


async def test_a_bad_message_is_dead_lettered(dispatcher: Dispatcher, recorder: Recorder) -> None:
    assert await dispatcher.handle_request(Record("p", 3, 7, b"k", b"{oops")) is Outcome.REFUSED
    (letter,) = recorder.on(TOPICS.dead_letters)
    assert b'"offset":7' in letter and b"not JSON" in letter


async def test_the_quota_charges_cost_weighted_tokens(recorder: Recorder, tmp_path: Path) -> None:
    # No tokenizer here: the counter takes UTF-8 bytes + 1, so this prompt is 3,001 tokens,
    # past 2k, where the context-length factor is 1.2: (3001 + 10) * 1.2 = 3613.2 -> 3614.
    long = request(1, tenant="w", max_tokens=10).model_copy(update={"prompt": "a" * 3000})
    for tpm, expected in ((3613, Outcome.REFUSED), (3614, Outcome.FORWARDED)):
        settings = Settings(home=tmp_path, tenant_tpm={"w": tpm}, worker_dead_after_s=0.3)
        dispatcher = dispatcher_for(settings, recorder)
        dispatcher.observe_heartbeat(heartbeat())
        loop = asyncio.create_task(dispatcher.run())
        assert await (await admit(dispatcher, long)) is expected
        loop.cancel()


async def test_a_restarted_job_waits_for_heartbeats_before_saying_no_worker(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    loop = asyncio.create_task(dispatcher.run())
    early = await admit(dispatcher, request(1))
    await asyncio.sleep(0.1)
    assert not early.done()  # within the first heartbeat period: it waits
    dispatcher.observe_heartbeat(heartbeat())
    assert await asyncio.wait_for(early, 1) is Outcome.FORWARDED
    loop.cancel()


def test_a_worker_lives_by_the_arrival_of_its_heartbeats_not_by_their_wall_stamps(
    dispatcher: Dispatcher, clock: ManualClock
) -> None:
    # Another host's clock (or the job's, moved on by a test) may be seconds off: a
    # heartbeat that arrives keeps its worker live whatever its stamp says.
    now = datetime.fromtimestamp(clock.time(), UTC)
    dispatcher.observe_heartbeat(heartbeat(worker_id="behind", sent_at=now - timedelta(hours=1)))
    assert set(dispatcher.metrics.workers) == {"behind"}
    clock.wall += 3600
    clock.mono += 0.29
    assert dispatcher._capacity() == 2
    clock.mono += 0.02  # no heartbeat for longer than worker_dead_after_s: lost
    assert dispatcher._capacity() == 0
    dispatcher.observe_heartbeat(heartbeat(worker_id="behind", sent_at=now))
    assert dispatcher._capacity() == 2


async def test_a_session_returns_to_its_worker_while_it_scores_within_the_margin(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=8, worker_id="a"))
    dispatcher.observe_heartbeat(heartbeat(capacity=8, worker_id="b"))
    loop = asyncio.create_task(dispatcher.run())
    first = request(1).model_copy(update={"session_id": "chat"})
    assert await (await admit(dispatcher, first)) is Outcome.FORWARDED
    (home,) = [t for t, _, _ in recorder.sent if t.startswith("tokenbus.worker.")]
    for n in range(2, 5):  # other sessions spread; they load the session's worker too
        other = request(n).model_copy(update={"session_id": f"s{n}"})
        assert await (await admit(dispatcher, other)) is Outcome.FORWARDED
    turn = request(5).model_copy(update={"session_id": "chat"})
    assert await (await admit(dispatcher, turn)) is Outcome.FORWARDED
    assert recorder.sent[-1][0] == home
    assert dispatcher.metrics.num_affine == 1
    loop.cancel()


async def until(condition: Callable[[], bool], timeout_s: float = 1.0) -> None:
    """Lets the dispatcher's recovery tasks run until ``condition`` holds."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (a pure condition: nothing to await)
            await asyncio.sleep(0.01)


def chunk(n: int, seq: int, tokens: list[int], finish: FinishReason | None = None) -> bytes:
    """A worker's reply record holding one chunk of request ``n``."""
    one = TokenChunk(
        request_id=f"r{n}",
        tenant_id="t",
        seq=seq,
        token_ids=tokens,
        num_tokens=len(tokens),
        finish_reason=finish,
        num_prompt_tokens=3 if finish else None,
    )
    return encode(TokenChunkBatch(tenant_id="t", chunks=[one]))


async def test_a_lost_run_s_request_resumes_elsewhere_from_what_was_delivered(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    assert await (await admit(dispatcher, request(1))) is Outcome.FORWARDED
    # The worker streamed two chunks, then restarted: a heartbeat of a new run.
    await recorder(REPLIES, b"t", chunk(1, 0, [11, 12]))
    await recorder(REPLIES, b"t", chunk(1, 1, [13]))
    dispatcher.observe_heartbeat(heartbeat(capacity=4, incarnation="run-2"))
    await until(lambda: len(recorder.on("tokenbus.worker.w")) == 2)
    first, again = [decode(WorkItem, v) for v in recorder.on("tokenbus.worker.w")]
    assert first.worker_incarnation == "run-1" and first.attempt == 0
    assert again.worker_incarnation == "run-2" and again.attempt == 1
    assert again.resume_token_ids == [11, 12, 13] and again.resume_seq == 2
    assert "resumed" in again.flags
    assert dispatcher.metrics.num_resumed == 1

    dispatcher.observe_usage(encode(attempt_usage(1, attempt=1)))  # the new attempt ends
    assert not dispatcher._in_flight
    loop.cancel()


def attempt_usage(n: int, *, attempt: int) -> UsageEvent:
    return UsageEvent.model_validate({**orjson.loads(usage_of(n)), "attempt": attempt})


async def test_a_run_presumed_lost_that_finishes_after_all_drops_the_attempt_sent_again(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    assert await (await admit(dispatcher, request(1))) is Outcome.FORWARDED
    await recorder(REPLIES, b"t", chunk(1, 0, [11, 12]))
    dispatcher.observe_heartbeat(heartbeat(capacity=4, incarnation="run-2"))
    await until(lambda: len(recorder.on("tokenbus.worker.w")) == 2)  # attempt 1, on run-2
    # Run-1 was only slow: attempt 0 ends, its usage reported after its last chunk.
    dispatcher.observe_usage(encode(attempt_usage(1, attempt=0)))
    await dispatcher.publish_raised()
    assert not dispatcher._in_flight and dispatcher.metrics.num_superseded == 1
    drops = [decode(CancelRequest, v) for v in recorder.on(TOPICS.aborts)]
    assert ("r1", 1, REASSIGNED) in {(d.request_id, d.attempt, d.reason) for d in drops}
    # Had attempt 1 reported too, nothing more happens: nothing is held for it.
    dispatcher.observe_usage(encode(attempt_usage(1, attempt=1)))
    assert not dispatcher._in_flight and dispatcher.metrics.num_superseded == 1
    loop.cancel()


async def test_a_lost_run_s_finished_request_gets_its_usage_not_a_rerun(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    assert await (await admit(dispatcher, request(1))) is Outcome.FORWARDED
    await recorder(REPLIES, b"t", chunk(1, 0, [11, 12]))
    await recorder(REPLIES, b"t", chunk(1, 1, [13], finish=FinishReason.STOP))
    dispatcher.observe_heartbeat(heartbeat(capacity=4, incarnation="run-2"))
    await until(lambda: bool(recorder.on(TOPICS.usage)))
    (usage,) = [decode(UsageEvent, v) for v in recorder.on(TOPICS.usage)]
    assert usage.status == "ok" and usage.num_completion_tokens == 3
    assert usage.num_prompt_tokens == 3 and "usage_from_replies" in usage.flags
    assert len(recorder.on("tokenbus.worker.w")) == 1  # not run again
    loop.cancel()


async def test_a_cancelled_request_of_a_lost_run_ends_instead_of_running_again(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    assert await (await admit(dispatcher, request(1))) is Outcome.FORWARDED
    await recorder(REPLIES, b"t", chunk(1, 0, [11, 12]))
    await cancel(dispatcher, "t", "r1")
    dispatcher.observe_heartbeat(heartbeat(capacity=4, incarnation="run-2"))
    await until(lambda: bool(recorder.on(TOPICS.usage)))
    last = recorder.chunks_on(REPLIES)[-1]
    assert last.seq == 1 and last.finish_reason == "abort"
    (usage,) = [decode(UsageEvent, v) for v in recorder.on(TOPICS.usage)]
    assert usage.status == "cancelled" and usage.num_completion_tokens == 2
    assert len(recorder.on("tokenbus.worker.w")) == 1
    loop.cancel()


async def test_forwards_never_exceed_the_seats_while_acks_are_pending(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    # The broker has not acknowledged any forward yet: the next picks must still count
    # every request already picked, or the whole queue would go out at once.
    acked = asyncio.Event()

    async def slow_publish(topic: str, key: bytes, value: bytes, headers: object = None) -> None:
        recorder.sent.append((topic, key, value))
        if topic == "tokenbus.worker.w":
            await acked.wait()

    dispatcher._publish = slow_publish
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    tasks = [await admit(dispatcher, request(n, priority=0)) for n in range(10)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(recorder.on("tokenbus.worker.w")) == 4
    assert dispatcher.metrics.num_in_flight == 4 and dispatcher.metrics.num_waiting == 6
    acked.set()
    await asyncio.sleep(0.01)
    assert [t.done() for t in tasks].count(True) == 4
    loop.cancel()


async def test_a_forward_the_broker_refuses_waits_and_goes_again_rather_than_failing(
    dispatcher: Dispatcher, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failed forward must not end the request (its event would be acked, and the
    # request lost): it queues again and is forwarded once the broker takes it.
    monkeypatch.setattr("stream_jobs.dispatcher.FORWARD_RETRY_S", 0.01)
    refusals = [KafkaTimeoutLike("the broker did not answer")]

    async def flaky_publish(topic: str, key: bytes, value: bytes, headers: object = None) -> None:
        if topic == "tokenbus.worker.w" and refusals:
            raise refusals.pop()
        recorder.sent.append((topic, key, value))

    dispatcher._publish = flaky_publish
    dispatcher.observe_heartbeat(heartbeat())
    loop = asyncio.create_task(dispatcher.run())
    outcome = await asyncio.wait_for(await admit(dispatcher, request(1)), timeout=2)
    assert outcome is Outcome.FORWARDED
    (forwarded,) = recorder.on("tokenbus.worker.w")
    assert decode(WorkItem, forwarded).request_id == "r1"
    assert dispatcher.metrics.num_forward_retries == 1
    assert dispatcher.metrics.num_in_flight == 1
    loop.cancel()


async def test_requests_that_wait_while_nothing_is_forwarded_are_reported(
    dispatcher: Dispatcher, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=1))
    loop = asyncio.create_task(dispatcher.run())
    await admit(dispatcher, request(1))
    await admit(dispatcher, request(2))  # waits: the one seat is taken
    await asyncio.sleep(0.1)
    assert "none was forwarded" not in caplog.text
    clock.advance(STALL_WARN_S)
    dispatcher.observe_heartbeat(heartbeat(capacity=1))  # the worker is still live
    await asyncio.sleep(0.1)
    assert "1 requests wait and none was forwarded for 10 s: 1 in flight, 1 seats" in caplog.text
    loop.cancel()


async def test_a_failing_turn_does_not_end_the_dispatch_loop(
    dispatcher: Dispatcher, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    turn = dispatcher._turn
    failures = [RuntimeError("a bug in one turn")]

    def flaky_turn() -> None:
        if failures:
            raise failures.pop()
        turn()

    monkeypatch.setattr(dispatcher, "_turn", flaky_turn)
    dispatcher.observe_heartbeat(heartbeat())
    loop = asyncio.create_task(dispatcher.run())
    assert await asyncio.wait_for(await admit(dispatcher, request(1)), 2) is Outcome.FORWARDED
    assert not failures and not loop.done()
    loop.cancel()


class KafkaTimeoutLike(Exception):
    """What a producer raises when its send is not acknowledged in time."""


def test_the_lag_of_each_input_shows_in_the_metrics(
    dispatcher: Dispatcher, clock: ManualClock
) -> None:
    finished = datetime.fromtimestamp(clock.time(), UTC) - timedelta(seconds=0.25)
    usage = decode(UsageEvent, usage_of(0)).model_copy(update={"finished_at": finished})
    dispatcher.observe_usage(encode(usage))
    dispatcher.note_lag("requests_p0", clock.time() - 0.04)
    text = generate_latest(job_registry(lambda: dispatcher.metrics)).decode()

    def lag(stream: str) -> float:
        (family,) = (f for f in text_string_to_metric_families(text) if f.name.endswith("lag_ms"))
        (value,) = (
            s.value for s in family.samples if s.labels == {"stream": stream, "quantile": "0.99"}
        )
        return float(value)

    assert 250 <= lag("usage_since_finish") < 1000
    assert 40 <= lag("requests_p0") < 1000


async def test_usage_read_together_steps_the_tier_down_one_tier_at_a_time(
    dispatcher: Dispatcher,
) -> None:
    loop = asyncio.create_task(dispatcher.run())
    dispatcher.observe_heartbeat(heartbeat(capacity=10))
    tasks = [await admit(dispatcher, request(n)) for n in range(16)]
    await asyncio.sleep(0.1)
    # 9 in flight (a seat is held for class 0) and 7 waiting: demand 160%.
    assert dispatcher.metrics.tier == 2
    tiers = []
    for n in range(5):  # five usage events in one batch, no dispatch turn between them
        dispatcher.observe_heartbeat(heartbeat(capacity=10))
        dispatcher.observe_usage(usage_of(n))
        tiers.append(dispatcher.metrics.tier)
    # 150%, 140%: held at 2 until below 145%; 130%, 120%: 1; 110%: below 115%, released.
    assert tiers == [2, 1, 1, 1, 0]
    loop.cancel()
    for task in tasks:
        task.cancel()
    await asyncio.gather(loop, *tasks, return_exceptions=True)


async def test_a_lost_batch_request_waits_for_a_worker_and_resumes_there(
    dispatcher: Dispatcher, recorder: Recorder, clock: ManualClock
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    assert await (await admit(dispatcher, request(1, priority=2))) is Outcome.FORWARDED
    assert await (await admit(dispatcher, request(2, priority=1))) is Outcome.FORWARDED
    await recorder(REPLIES, b"t", chunk(1, 0, [11, 12]))
    # The only worker stops beating: lost after worker_dead_after_s (0.3 s here).
    clock.advance(0.29)
    await asyncio.sleep(0.1)  # two turns of the dispatch loop
    assert dispatcher.metrics.num_workers_lost == 0
    clock.advance(0.02)
    await until(lambda: dispatcher.metrics.num_workers_lost == 1)

    def answered() -> dict[str, TokenChunk]:
        return {c.request_id: c for c in recorder.chunks_on(REPLIES) if c.error is not None}

    await until(lambda: "r2" in answered())
    await asyncio.sleep(0.1)  # two more turns, in which the batch one must stay unanswered
    # The interactive one is answered no_worker; the batch one waits, unanswered.
    found = answered()
    assert set(found) == {"r2"} and found["r2"].error is not None
    assert found["r2"].error.code == "no_worker"
    assert len(recorder.on("tokenbus.worker.w")) == 2
    # A worker comes back: the batch request resumes there, after what was delivered.
    dispatcher.observe_heartbeat(heartbeat(capacity=4, incarnation="run-2"))
    await until(lambda: len(recorder.on("tokenbus.worker.w")) == 3)
    again = decode(WorkItem, recorder.on("tokenbus.worker.w")[-1])
    assert again.request_id == "r1" and again.attempt == 1
    assert again.worker_incarnation == "run-2"
    assert again.resume_token_ids == [11, 12] and again.resume_seq == 1
    assert not [c for c in recorder.chunks_on(REPLIES) if c.request_id == "r1" and c.error]
    loop.cancel()


async def test_a_lost_batch_request_waiting_to_resume_is_dropped_if_its_run_finishes_after_all(
    dispatcher: Dispatcher, recorder: Recorder, clock: ManualClock
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    assert await (await admit(dispatcher, request(1, priority=2))) is Outcome.FORWARDED
    clock.advance(0.31)  # the only worker is presumed lost: r1 waits for another
    await until(lambda: dispatcher.metrics.num_workers_lost == 1)
    await until(lambda: ("t", "r1") in dispatcher._waiting)
    dispatcher.observe_usage(encode(attempt_usage(1, attempt=0)))  # it finished after all
    assert ("t", "r1") not in dispatcher._waiting and dispatcher.metrics.num_superseded == 1
    dispatcher.observe_heartbeat(heartbeat(capacity=4, incarnation="run-2"))
    await asyncio.sleep(0.1)  # turns of the dispatch loop: nothing goes out again
    assert len(recorder.on("tokenbus.worker.w")) == 1
    loop.cancel()
