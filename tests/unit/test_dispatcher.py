"""The dispatcher's decisions, with an in-memory window store and a recording publisher."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from schemas import (
    CancelRequest,
    InferenceRequest,
    SamplingParams,
    TokenChunk,
    UsageEvent,
    WorkerStatus,
    decode,
    encode,
)
from stream_jobs.dispatcher import Dispatcher, MemoryWindowStore, Outcome
from tokenbus.config import Settings
from tokenbus.topics import Topics

TOPICS = Topics()


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []

    async def __call__(self, topic: str, key: bytes, value: bytes) -> None:
        self.sent.append((topic, key, value))

    def on(self, topic: str) -> list[bytes]:
        return [value for t, _, value in self.sent if t == topic]


def request(n: int, tenant: str = "t", priority: int = 1, max_tokens: int = 10) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"r{n}",
        session_id="s",
        tenant_id=tenant,
        priority=priority,
        model="m",
        prompt="hello",
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_to="replies",
    )


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def dispatcher(recorder: Recorder, tmp_path: Path) -> Dispatcher:
    settings = Settings(
        home=tmp_path,
        tenant_tpm={"small": 40},
        default_priority_class=0,
        worker_dead_after_s=0.3,
    )
    return Dispatcher(settings, recorder, MemoryWindowStore())


def heartbeat(capacity: int = 2) -> bytes:
    return encode(
        WorkerStatus(worker_id="w", model="m", request_topic="w-topic", max_num_seqs=capacity)
    )


async def admit(dispatcher: Dispatcher, req: InferenceRequest) -> asyncio.Task[Outcome]:
    task = asyncio.create_task(
        dispatcher.handle_request("p", 0, 0, req.tenant_id.encode(), encode(req))
    )
    await asyncio.sleep(0)
    return task


async def test_forwards_to_a_live_worker_and_refuses_without_one(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    loop = asyncio.create_task(dispatcher.run())
    assert await (await admit(dispatcher, request(1))) is Outcome.REFUSED
    (chunk,) = [decode(TokenChunk, v) for v in recorder.on("replies")]
    assert chunk.error is not None and chunk.error.code == "no_worker"

    dispatcher.observe_heartbeat(heartbeat())
    assert await (await admit(dispatcher, request(2))) is Outcome.FORWARDED
    (forwarded,) = [decode(InferenceRequest, v) for v in recorder.on("w-topic")]
    assert forwarded.worker_id == "w" and forwarded.request_id == "r2"
    loop.cancel()


async def test_waits_when_saturated_but_class_zero_uses_the_headroom(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    for n in range(4):
        assert await (await admit(dispatcher, request(n))) is Outcome.FORWARDED
    standard = await admit(dispatcher, request(10, priority=1))
    await asyncio.sleep(0.1)
    assert not standard.done()  # four slots, four in flight: it waits in the job
    vip = await admit(dispatcher, request(11, priority=0))
    assert await asyncio.wait_for(vip, 1) is Outcome.FORWARDED  # 25% headroom for class 0

    dispatcher.observe_usage(
        encode(
            UsageEvent(
                request_id="r0",
                session_id="s",
                tenant_id="t",
                model="m",
                status="ok",
                num_prompt_tokens=2,
                num_completion_tokens=10,
                created_at=request(0).created_at,
            )
        )
    )
    await asyncio.sleep(0.1)
    assert not standard.done()  # five in flight still fill four slots
    dispatcher.observe_usage(
        encode(
            UsageEvent(
                request_id="r1",
                session_id="s",
                tenant_id="t",
                model="m",
                status="ok",
                num_prompt_tokens=2,
                num_completion_tokens=10,
                created_at=request(1).created_at,
            )
        )
    )
    assert await asyncio.wait_for(standard, 1) is Outcome.FORWARDED
    order = [decode(InferenceRequest, v).request_id for v in recorder.on("w-topic")]
    assert order == ["r0", "r1", "r2", "r3", "r11", "r10"]
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
    chunk = decode(TokenChunk, recorder.on("replies")[-1])
    assert chunk.error is not None and chunk.error.code == "quota_exceeded"
    assert chunk.error.retry_after_s is not None and 59 < chunk.error.retry_after_s <= 60
    usage = decode(UsageEvent, recorder.on(TOPICS.usage)[-1])
    assert usage.status == "rejected" and usage.tenant_id == "small"
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
    await dispatcher.handle_cancel(encode(CancelRequest(request_id="r2", tenant_id="small")))
    assert await waiting is Outcome.CANCELLED
    assert [decode(InferenceRequest, v).request_id for v in recorder.on("w-topic")] == ["r1"]
    # Refunded: another request of the same size fits in the 40-token window again.
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    assert (
        await (await admit(dispatcher, request(3, tenant="small", max_tokens=10)))
        is Outcome.FORWARDED
    )
    loop.cancel()


async def test_a_bad_message_is_dead_lettered(dispatcher: Dispatcher, recorder: Recorder) -> None:
    assert await dispatcher.handle_request("p", 3, 7, b"k", b"{oops") is Outcome.REFUSED
    (letter,) = recorder.on(TOPICS.dead_letters)
    assert b'"offset":7' in letter and b"not JSON" in letter


async def test_the_quota_charges_cost_weighted_tokens(recorder: Recorder, tmp_path: Path) -> None:
    # No tokenizer here: the counter takes UTF-8 bytes + 1, so this prompt is 3,001 tokens,
    # past 2k, where the context-length factor is 1.2: (3001 + 10) * 1.2 = 3613.2 -> 3614.
    long = request(1, tenant="w", max_tokens=10).model_copy(update={"prompt": "a" * 3000})
    for tpm, expected in ((3613, Outcome.REFUSED), (3614, Outcome.FORWARDED)):
        settings = Settings(home=tmp_path, tenant_tpm={"w": tpm}, worker_dead_after_s=0.3)
        dispatcher = Dispatcher(settings, recorder, MemoryWindowStore())
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
