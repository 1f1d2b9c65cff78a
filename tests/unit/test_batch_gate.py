"""The batch gate (workers.batch_gate) and a worker's class 2 lines paused for interactive work."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench.fake_engine import FakeEngine
from schemas import FinishReason, UsageEvent, UsageStatus, decode
from tests.unit.test_worker import REPLY_TO, RecordingProducer, work_item
from tokenbus.batch_yield import YieldPolicy
from tokenbus.chunks import decode_batch
from tokenbus.config import Settings
from workers.batch_gate import BatchGate, SeatLearner, plan_seats
from workers.interface import EngineDelta, GenerateOptions, GenerateParams, Prompt
from workers.replies import ReplyBatcher
from workers.worker import Worker, create_batch_gate


@pytest.mark.parametrize(
    ("running", "waiting", "cap", "expected"),
    [
        (3, 5, None, (5, 0)),  # no cap: every waiting line starts
        (1, 5, 4, (3, 0)),  # room for three under the cap
        (4, 5, 4, (0, 0)),  # at the cap: nothing starts, nothing pauses
        (6, 2, 4, (0, 2)),  # above it: the excess pauses
        (3, 0, 0, (0, 3)),  # a cap of none pauses every line
    ],
)
def test_plan_seats_starts_up_to_the_cap_and_pauses_what_is_above_it(
    running: int, waiting: int, cap: int | None, expected: tuple[int, int]
) -> None:
    assert plan_seats(running, waiting, cap) == expected


def test_the_learner_starts_at_none_halves_on_a_slow_request_and_probes_after_a_run() -> None:
    learner = SeatLearner(max_seats=4, ratio=1.5, probe_after=3)
    assert learner.seats == 0
    learner.observe(0.040, num_batch_running=0)  # a baseline sample
    assert learner.baseline() == 0.040
    for _ in range(10):  # no batch line wants a seat: nothing to learn
        learner.observe(0.050, num_batch_running=0)
    assert learner.seats == 0
    for _ in range(3):  # three within 60 ms in a row, lines waiting: one line more
        learner.observe(0.050, num_batch_running=0, num_batch_waiting=5)
    assert learner.seats == 1
    for _ in range(6):
        learner.observe(0.055, num_batch_running=learner.seats, num_batch_waiting=5)
    assert learner.seats == 3  # up by one each three
    learner.observe(0.100, num_batch_running=0)  # slow, but no batch line ran: not theirs
    assert learner.seats == 3
    learner.observe(0.100, num_batch_running=3)  # slow beside batch lines: halved
    assert learner.seats == 1 and learner.num_within == 0
    learner.observe(0.100, num_batch_running=1)
    assert learner.seats == 0
    for _ in range(100):
        learner.observe(0.041, num_batch_running=learner.seats, num_batch_waiting=5)
    assert learner.seats == 4  # never above the job's cap


def test_the_learners_baseline_is_the_lowest_of_its_window() -> None:
    learner = SeatLearner(max_seats=4, window=3)
    for ttft in (0.030, 0.050, 0.060, 0.070):
        learner.observe(ttft, num_batch_running=0)
    assert learner.baseline() == 0.050  # 0.030 left the window


class Aborts:
    def __init__(self) -> None:
        self.ids: list[str] = []

    async def __call__(self, engine_id: str) -> None:
        self.ids.append(engine_id)


async def test_interactive_work_pauses_the_newest_lines_above_the_cap_and_its_end_resumes() -> None:
    aborts = Aborts()
    learned = SeatLearner(max_seats=1, seats=1)  # one line was shown to fit
    gate = BatchGate(YieldPolicy(seats_per_worker=1, hold_s=0.05), "m", aborts, learner=learned)
    for n in range(3):
        await gate.enter(f"line{n}")  # no interactive work: no cap
        assert gate.bind(f"line{n}", f"engine{n}")
    gate.interactive_started()
    await asyncio.sleep(0)  # the aborts run as tasks
    assert sorted(aborts.ids) == ["engine1", "engine2"]  # the oldest line keeps its seat
    assert gate.is_paused("line1") and gate.is_paused("line2") and not gate.is_paused("line0")
    assert gate.num_pauses == 2
    # The paused lines' streams end; they wait to go on.
    assert gate.leave("line2") and gate.leave("line1")
    back = [asyncio.create_task(gate.enter(k, paused_before=True)) for k in ("line1", "line2")]
    new = asyncio.create_task(gate.enter("line3"))
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in [*back, new]) and gate.num_waiting == 3
    gate.interactive_ended()
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in [*back, new])  # the hold (50 ms) still caps them
    await asyncio.wait_for(asyncio.gather(*back, new), 1.0)  # then the cap lifts
    assert gate.num_waiting == 0 and gate.cap() is None


async def test_the_interactive_request_goes_in_only_once_the_aborts_have_gone_out() -> None:
    sent = asyncio.Event()

    async def abort(engine_id: str) -> None:
        await sent.wait()  # the engine client's send, not yet done

    gate = BatchGate(YieldPolicy(seats_per_worker=1, hold_s=0.05), "m", abort)
    await gate.enter("line0")  # no interactive work: no cap
    assert gate.bind("line0", "engine0")
    gate.interactive_started()  # learned seats: none, so line0 pauses
    waiting = asyncio.create_task(gate.aborts_sent())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    sent.set()
    await asyncio.wait_for(waiting, 1.0)


async def test_a_line_that_comes_during_the_hold_starts_once_the_hold_is_over() -> None:
    gate = BatchGate(YieldPolicy(seats_per_worker=1, hold_s=0.05), "m", Aborts())
    gate.interactive_started()
    gate.interactive_ended()  # no batch line anywhere: nothing waits yet
    line = asyncio.create_task(gate.enter("late"))  # during the hold: it waits...
    await asyncio.sleep(0.01)
    assert not line.done()
    await asyncio.wait_for(line, 1.0)  # ...and starts when the hold is over


async def test_under_the_cap_a_waiting_line_starts_when_a_running_one_ends() -> None:
    policy = YieldPolicy(seats_per_worker=1, hold_s=60)
    gate = BatchGate(policy, "m", Aborts(), learner=SeatLearner(max_seats=1, seats=1))
    gate.interactive_started()
    await gate.enter("a")
    waiting = asyncio.create_task(gate.enter("b"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert not gate.leave("a")  # ended by itself: not a pause
    await asyncio.wait_for(waiting, 1.0)


async def test_a_line_paused_before_it_starts_never_starts_and_a_cancelled_waiter_goes() -> None:
    aborts = Aborts()
    gate = BatchGate(YieldPolicy(seats_per_worker=0, hold_s=60), "m", aborts)
    await gate.enter("a")
    gate.interactive_started()  # "a" holds a seat but has no engine id yet
    assert not gate.bind("a", "engine-a") and aborts.ids == []
    assert gate.leave("a")
    waiter = asyncio.create_task(gate.enter("a", paused_before=True))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.num_waiting == 0


def test_the_gate_is_off_when_its_cap_could_never_bind(tmp_path: Path) -> None:
    engine = FakeEngine("tiny", max_num_seqs=4)
    assert create_batch_gate(Settings(home=tmp_path), engine) is None  # 4 seats of 4
    on = Settings(home=tmp_path, batch_yield_seats_per_worker=1)
    assert create_batch_gate(on, engine) is not None


class RecordingEngine(FakeEngine):
    """The pretend engine, stepping every 5 ms, noting each part's prompt and length."""

    def __init__(self) -> None:
        super().__init__("tiny", max_num_seqs=4, step_s=0.005)
        self.parts: list[tuple[str, int, int]] = []  # (engine id, prompt length, max_tokens)

    async def deltas(
        self, request_id: str, prompt: str | list[int], params: GenerateParams
    ) -> AsyncIterator[EngineDelta]:
        length = len(prompt) if isinstance(prompt, list) else len(self.tokenize(prompt))
        self.parts.append((request_id, length, params.max_tokens))
        async for delta in super().deltas(request_id, prompt, params):
            yield delta


async def batch_worker(
    tmp_path: Path, engine: FakeEngine, **overrides: Any
) -> tuple[Worker, RecordingProducer]:
    settings = Settings(
        home=tmp_path,
        worker_id="w1",
        # A delta per token unless a test says otherwise: it can pause a line anywhere.
        **{
            "batch_yield_seats_per_worker": 0,
            "batch_yield_hold_s": 0.05,
            "batch_stream_interval": 1,
            **overrides,
        },
    )
    worker = Worker(settings, engine)
    producer = RecordingProducer()
    worker._producer = producer
    worker._replies = ReplyBatcher(producer)
    await engine.start()
    return worker, producer


async def until(condition: Any, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


async def test_a_paused_batch_line_goes_on_in_one_stream_billed_once(tmp_path: Path) -> None:
    engine = RecordingEngine()
    worker, producer = await batch_worker(tmp_path, engine)
    gate = worker._batch_gate
    assert gate is not None
    line = asyncio.create_task(worker._serve(work_item(max_tokens=20, priority=2)))
    await until(lambda: len(producer.on(REPLY_TO)) >= 3)
    gate.interactive_started()
    await asyncio.sleep(0.05)  # paused: no step of it runs
    made_when_paused = len(producer.on(REPLY_TO))
    await asyncio.sleep(0.05)
    assert len(producer.on(REPLY_TO)) == made_when_paused and not line.done()
    gate.interactive_ended()
    await asyncio.wait_for(line, 2.0)
    await worker._replies.drain()  # type: ignore[union-attr]
    chunks = [c for raw in producer.on(REPLY_TO) for c in decode_batch(raw).chunks]
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # no gap, no repeat
    assert sum(c.num_tokens for c in chunks) == 20
    assert [c.finish_reason for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    prompt_len = len(engine.tokenize("hello there"))
    (first, second) = engine.parts
    made = 20 - second[2]
    assert first == ("acme/r1/0", prompt_len, 20)
    assert second == ("acme/r1/0/part1", prompt_len + made, 20 - made) and 0 < made < 20
    (usage,) = [decode(UsageEvent, raw) for raw in producer.on(worker._topics.usage)]
    assert usage.status is UsageStatus.OK and usage.num_completion_tokens == 20
    assert usage.num_prompt_tokens == round(len("hello there") / 1.8)  # the first part's
    assert usage.last_seq == chunks[-1].seq and gate.num_pauses == 1
    registry = worker.metrics.registry
    labels = {"model": "tiny", "worker": "w1"}
    assert registry.get_sample_value("tokenbus_worker_batch_pauses_total", labels) == 1
    assert registry.get_sample_value("tokenbus_worker_batch_lines_waiting", labels) == 0


class OptionsEngine(RecordingEngine):
    """Notes the options each part ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.options: dict[str, GenerateOptions] = {}

    def generate(
        self, request_id: str, prompt: Prompt, params: GenerateParams, options: GenerateOptions
    ) -> AsyncIterator[EngineDelta]:
        self.options[request_id] = options
        return super().generate(request_id, prompt, params, options)


def token_counts(producer: RecordingProducer, request_id: str) -> list[int]:
    chunks = [c for raw in producer.on(REPLY_TO) for c in decode_batch(raw).chunks]
    mine = [c for c in chunks if c.request_id == request_id]
    assert [c.seq for c in mine] == list(range(len(mine)))  # no gap, no repeat
    return [c.num_tokens for c in mine]


async def test_batch_lines_stream_at_the_batch_interval_and_interactive_requests_per_token(
    tmp_path: Path,
) -> None:
    engine = OptionsEngine()
    worker, producer = await batch_worker(tmp_path, engine, batch_stream_interval=8)
    await worker._serve(work_item(max_tokens=20, priority=2))
    await worker._serve(work_item(max_tokens=5, request_id="r2", priority=1))
    await worker._replies.drain()  # type: ignore[union-attr]
    assert engine.options["acme/r1/0"].stream_interval == 8
    assert engine.options["acme/r2/0"].stream_interval is None  # the engine's own
    assert token_counts(producer, "r1") == [1, 8, 8, 3]  # the first at once, the end too
    assert token_counts(producer, "r2") == [1] * 5
    usage = {
        e.request_id: e
        for e in (decode(UsageEvent, raw) for raw in producer.on(worker._topics.usage))
    }
    assert usage["r1"].num_completion_tokens == 20 and usage["r1"].last_seq == 3


async def test_a_batch_line_never_streams_finer_than_the_workers_interval(tmp_path: Path) -> None:
    engine = OptionsEngine()
    worker, producer = await batch_worker(
        tmp_path, engine, stream_interval=4, batch_stream_interval=2
    )
    await worker._serve(work_item(max_tokens=10, priority=2))
    await worker._replies.drain()  # type: ignore[union-attr]
    assert engine.options["acme/r1/0"].stream_interval == 4
    assert token_counts(producer, "r1") == [1, 4, 4, 1]


async def test_a_line_paused_while_its_interval_held_tokens_sends_them_and_makes_none_twice(
    tmp_path: Path,
) -> None:
    engine = OptionsEngine()
    worker, producer = await batch_worker(tmp_path, engine, batch_stream_interval=8)
    gate = worker._batch_gate
    assert gate is not None
    line = asyncio.create_task(worker._serve(work_item(max_tokens=40, priority=2)))
    # Paused after its fifth step: the first token went out, four are held.
    await until(lambda: len(engine._generated) >= 5)
    gate.interactive_started()
    await until(lambda: gate.num_pauses == 1)
    gate.interactive_ended()
    await asyncio.wait_for(line, 2.0)
    await worker._replies.drain()  # type: ignore[union-attr]
    counts = token_counts(producer, "r1")
    assert sum(counts) == 40
    prompt_len = len(engine.tokenize("hello there"))
    (first, second) = engine.parts
    made = 40 - second[2]  # what the first part made: the second goes on from all of it
    assert first == ("acme/r1/0", prompt_len, 40)
    assert second == ("acme/r1/0/part1", prompt_len + made, 40 - made) and 1 < made < 8
    assert counts[:2] == [1, made - 1]  # the held tokens went out with the pause
    assert engine.options["acme/r1/0/part1"].stream_interval == 8


async def test_interactive_lines_are_never_paused_and_a_cancel_while_paused_ends_the_line(
    tmp_path: Path,
) -> None:
    engine = RecordingEngine()
    worker, producer = await batch_worker(tmp_path, engine)
    gate = worker._batch_gate
    assert gate is not None
    batch = asyncio.create_task(worker._serve(work_item(max_tokens=40, priority=2)))
    await until(lambda: len(producer.on(REPLY_TO)) >= 2)
    interactive = asyncio.create_task(
        worker._serve(work_item(max_tokens=10, request_id="r2", priority=1))
    )
    await asyncio.wait_for(interactive, 2.0)  # ran to its end beside the paused line
    assert gate.learner.baseline() is not None  # its first token taught the learner
    worker._cancels.note("acme", "r1", time.monotonic(), attempt=None, reason="cancelled")
    await asyncio.wait_for(batch, 2.0)  # the hold ends, the line sees its cancel
    await worker._replies.drain()  # type: ignore[union-attr]
    usage = {
        e.request_id: e
        for e in (decode(UsageEvent, raw) for raw in producer.on(worker._topics.usage))
    }
    assert usage["r2"].status is UsageStatus.OK and usage["r2"].num_completion_tokens == 10
    assert usage["r1"].status is UsageStatus.CANCELLED
    assert usage["r1"].num_completion_tokens < 40
    assert len(engine.parts) == 2  # r1's first part and r2: no engine work after the cancel
    chunks = [c for raw in producer.on(REPLY_TO) for c in decode_batch(raw).chunks]
    r1 = [c for c in chunks if c.request_id == "r1"]
    assert [c.seq for c in r1] == list(range(len(r1))) and r1[
        -1
    ].finish_reason is FinishReason.ABORT


class AbortsBeforeItsFirstToken(RecordingEngine):
    """As vLLM answers the abort of a request that has made no token yet: one delta with
    the prompt's counts and no token. The part after the pause runs as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = asyncio.Event()

    async def abort(self, request_id: str) -> None:
        self.aborted.set()

    async def deltas(
        self, request_id: str, prompt: str | list[int], params: GenerateParams
    ) -> AsyncIterator[EngineDelta]:
        if request_id.endswith("/part1"):
            async for delta in super().deltas(request_id, prompt, params):
                yield delta
            return
        self.parts.append((request_id, -1, params.max_tokens))
        await self.aborted.wait()
        yield EngineDelta("", [], "abort", num_prompt_tokens=6, num_cached_tokens=2)


async def test_a_line_paused_before_its_first_token_is_billed_its_prompt(tmp_path: Path) -> None:
    engine = AbortsBeforeItsFirstToken()
    worker, producer = await batch_worker(tmp_path, engine)
    gate = worker._batch_gate
    assert gate is not None
    line = asyncio.create_task(worker._serve(work_item(max_tokens=20, priority=2)))
    await until(lambda: len(engine.parts) == 1)
    gate.interactive_started()
    await asyncio.sleep(0.05)
    gate.interactive_ended()
    await asyncio.wait_for(line, 2.0)
    await worker._replies.drain()  # type: ignore[union-attr]
    chunks = [c for raw in producer.on(REPLY_TO) for c in decode_batch(raw).chunks]
    assert sum(c.num_tokens for c in chunks) == 20
    assert [p[0] for p in engine.parts] == ["acme/r1/0", "acme/r1/0/part1"]
    (usage,) = [decode(UsageEvent, raw) for raw in producer.on(worker._topics.usage)]
    # The first part's counts, which its abort carried: not 0, and not the second part's
    # (whose prompt, as token ids, the pretend engine counts one a character).
    assert (usage.num_prompt_tokens, usage.num_cached_tokens) == (6, 2)
    assert usage.num_completion_tokens == 20 and gate.num_pauses == 1


def test_a_failed_probe_doubles_the_wait_for_the_next_and_one_that_holds_resets_it() -> None:
    learner = SeatLearner(max_seats=4, ratio=1.5, probe_after=3, probe_after_max=12)
    assert learner.observe(0.040, num_batch_running=0) == ()  # baseline 40 ms: target 60 ms

    def within_until_probe() -> int:
        """Requests within the target, lines waiting, until the learner lets one more run."""
        seats, count = learner.seats, 0
        steps: tuple[str, ...] = ()
        while learner.seats == seats:
            assert steps == ()  # nothing happened on the requests before the probe
            steps = learner.observe(0.050, num_batch_running=learner.seats, num_batch_waiting=5)
            count += 1
            assert count < 100
        assert steps[-1] == "probe"
        return count

    waits = []
    for _ in range(4):  # each probe fails on the next request, beside the line it added
        waits.append(within_until_probe())
        assert learner.seats == 1
        failed = learner.observe(0.200, num_batch_running=1, num_batch_waiting=5)
        assert failed == ("probe_failed",) and learner.seats == 0
    assert waits == [3, 6, 12, 12]  # doubled each time, up to probe_after_max
    assert within_until_probe() == 12 and learner.seats == 1
    steps = [learner.observe(0.050, num_batch_running=1) for _ in range(3)]
    assert steps == [(), (), ("probe_held",)]  # three within the target beside its line
    assert learner.probe_wait == 3
    assert within_until_probe() == 3 and learner.seats == 2


def test_a_slow_request_from_seats_already_shown_to_fit_does_not_slow_the_probes() -> None:
    learner = SeatLearner(max_seats=4, ratio=1.5, probe_after=2, seats=2)
    learner.observe(0.040, num_batch_running=0)
    assert learner.observe(0.200, num_batch_running=2, num_batch_waiting=5) == ("halved",)
    assert learner.seats == 1 and learner.probe_wait == 2


def test_a_probe_that_holds_and_the_next_probe_can_come_on_one_request() -> None:
    learner = SeatLearner(max_seats=4, ratio=1.5, probe_after=2)
    learner.observe(0.040, num_batch_running=0)
    steps = [learner.observe(0.050, num_batch_running=0, num_batch_waiting=5) for _ in range(2)]
    assert steps == [(), ("probe",)] and learner.seats == 1
    steps = [learner.observe(0.050, num_batch_running=1, num_batch_waiting=5) for _ in range(2)]
    assert steps == [(), ("probe_held", "probe")] and learner.seats == 2


async def test_the_worker_counts_what_its_learner_did_and_shows_the_seats(tmp_path: Path) -> None:
    engine = RecordingEngine()
    worker, producer = await batch_worker(
        tmp_path, engine, batch_yield_seats_per_worker=1, batch_yield_probe_after=1
    )
    gate = worker._batch_gate
    assert gate is not None
    registry = worker.metrics.registry
    labels = {"model": "tiny", "worker": "w1"}
    assert registry.get_sample_value("tokenbus_worker_batch_seats", labels) == 0
    batch = asyncio.create_task(worker._serve(work_item(max_tokens=40, priority=2)))
    await until(lambda: len(producer.on(REPLY_TO)) >= 2)
    await worker._serve(work_item(max_tokens=10, request_id="r2", priority=1))
    # It paused the line; its first token was the baseline and, with the line waiting,
    # one request within the target: the learner let the line back in beside it.
    probes = {**labels, "step": "probe"}
    assert registry.get_sample_value("tokenbus_worker_batch_probes_total", probes) == 1
    assert registry.get_sample_value("tokenbus_worker_batch_seats", labels) == 1
    assert gate.num_pauses == 1
    await asyncio.wait_for(batch, 2.0)
