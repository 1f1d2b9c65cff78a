"""A job that starts (or is given partitions) adopts the requests an earlier run of it
forwarded: it watches their worker runs, and sends them again when a run is gone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from schemas import REASSIGNED, CancelRequest, WorkItem, decode
from stream_jobs.dispatcher import Dispatcher, Outcome
from stream_jobs.ledger import State
from tests.unit.fakes import TOPICS, ManualClock, MemoryLedger, Recorder
from tests.unit.test_dispatcher import (
    REPLIES,
    admit,
    chunk,
    dispatcher_for,
    heartbeat,
    request,
    until,
    usage_of,
)
from tokenbus.config import Settings


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, default_priority_class=0, worker_dead_after_s=0.3)


@dataclass
class Restart:
    """A first run of the job forwarded batch requests 1..n to run-1 of worker w, then
    died; ``second`` is the next run, over the same topics and ledger."""

    recorder: Recorder
    ledger: MemoryLedger
    second: Dispatcher

    def forwarded(self) -> list[WorkItem]:
        return [decode(WorkItem, v) for v in self.recorder.on("tokenbus.worker.w")]


async def restart_after(settings: Settings, clock: ManualClock, n: int) -> Restart:
    recorder, ledger = Recorder(), MemoryLedger()
    first = dispatcher_for(settings, recorder, clock, ledger)
    first.observe_heartbeat(heartbeat(capacity=8))
    loop = asyncio.create_task(first.run())
    for i in range(1, n + 1):
        assert await (await admit(first, request(i, priority=2))) is Outcome.FORWARDED
    loop.cancel()
    return Restart(recorder, ledger, dispatcher_for(settings, recorder, clock, ledger))


async def adopted_on_a_live_run(
    settings: Settings, clock: ManualClock
) -> tuple[Restart, asyncio.Task[None]]:
    """The next run adopts request 1 while run-1 still beats, and starts its loop."""
    restart = await restart_after(settings, clock, 1)
    restart.second.observe_heartbeat(heartbeat(capacity=8))  # run-1 still beats
    assert await restart.second.adopt({0}) == 1
    return restart, asyncio.create_task(restart.second.run())


async def test_the_ledger_says_where_each_forwarded_request_runs(
    settings: Settings, clock: ManualClock
) -> None:
    restart = await restart_after(settings, clock, 2)
    for n in (1, 2):
        entry = restart.ledger.get("t", f"r{n}")
        assert entry is not None and entry.state is State.FORWARDED
        assert entry.forward is not None and entry.forward.home == 0
        topic, key, value = restart.recorder.sent[entry.forward.offset]
        assert (topic, key) == ("tokenbus.worker.w", b"t")
        assert decode(WorkItem, value).request_id == f"r{n}"


async def test_a_restarted_job_sends_again_what_a_run_lost_while_it_was_down(
    settings: Settings, clock: ManualClock
) -> None:
    restart = await restart_after(settings, clock, 2)
    recorder, second = restart.recorder, restart.second
    await recorder(REPLIES, b"t", chunk(1, 0, [11, 12]))  # r1 had streamed two tokens
    # The worker restarted too while the job was down (a new run, run-2).
    assert await second.adopt({0}) == 2
    assert second.metrics.num_adopted == 2
    loop = asyncio.create_task(second.run())
    second.observe_heartbeat(heartbeat(capacity=8, incarnation="run-2"))
    await asyncio.sleep(0.1)  # two turns: run-1 is not yet overdue
    assert len(restart.forwarded()) == 2
    clock.advance(0.31)  # run-1 not seen for worker_dead_after_s: gone
    second.observe_heartbeat(heartbeat(capacity=8, incarnation="run-2"))
    await until(lambda: len(restart.forwarded()) == 4)
    again = {item.request_id: item for item in restart.forwarded()[2:]}
    assert {item.worker_incarnation for item in again.values()} == {"run-2"}
    assert again["r1"].attempt == 1 and again["r1"].resume_token_ids == [11, 12]
    assert again["r2"].attempt == 1 and again["r2"].resume_seq == 0
    # run-1, were it only slow, drops attempt 0 of each.
    aborts = [decode(CancelRequest, v) for v in recorder.on(TOPICS.aborts)]
    assert {(a.request_id, a.attempt, a.reason) for a in aborts} == {
        ("r1", 0, REASSIGNED),
        ("r2", 0, REASSIGNED),
    }
    loop.cancel()


async def test_an_adopted_request_on_a_live_run_is_left_to_finish(
    settings: Settings, clock: ManualClock
) -> None:
    restart, loop = await adopted_on_a_live_run(settings, clock)
    second = restart.second
    for _ in range(2):  # past worker_dead_after_s since the adoption, beating
        clock.advance(0.2)
        second.observe_heartbeat(heartbeat(capacity=8))
    await asyncio.sleep(0.1)
    assert len(restart.forwarded()) == 1 and not restart.recorder.on(TOPICS.aborts)
    assert second.metrics.num_in_flight == 1  # it holds one of run-1's seats here too
    second.observe_usage(usage_of(1))
    assert not second._in_flight
    loop.cancel()


async def test_an_adopted_request_is_sent_again_when_its_live_run_dies_later(
    settings: Settings, clock: ManualClock
) -> None:
    restart, loop = await adopted_on_a_live_run(settings, clock)
    second = restart.second
    await asyncio.sleep(0.1)  # seen live: from now on the registry watches its run
    second.observe_heartbeat(heartbeat(capacity=8, incarnation="run-2"))
    await until(lambda: len(restart.forwarded()) == 2)
    assert restart.forwarded()[1].attempt == 1
    assert second.metrics.num_workers_lost == 1
    loop.cancel()


async def test_what_finished_or_runs_here_already_is_not_adopted(
    settings: Settings, clock: ManualClock
) -> None:
    restart = await restart_after(settings, clock, 2)
    second = restart.second
    second.observe_usage(usage_of(1))  # r1's usage: DONE in the ledger
    entry = restart.ledger.get("t", "r1")
    assert entry is not None and entry.state is State.DONE
    assert await second.adopt({0}) == 1
    assert set(second._in_flight) == {("t", "r2")}
    assert await second.adopt({0}) == 0  # held already
    assert await second.adopt({1}) == 0  # another partition's


async def test_a_forwarded_copy_that_cannot_be_read_back_is_reported(
    settings: Settings, clock: ManualClock
) -> None:
    restart = await restart_after(settings, clock, 1)
    # The worker topic's record is gone (retention), or holds another request.
    entry = restart.ledger.get("t", "r1")
    assert entry is not None and entry.forward is not None
    sent = restart.recorder.sent
    other = orjson.loads(sent[entry.forward.offset][2]) | {"request_id": "r9"}
    sent[entry.forward.offset] = ("tokenbus.worker.w", b"t", orjson.dumps(other))
    assert await restart.second.adopt({0}) == 0
    assert restart.second.metrics.num_adoptions_failed == 1 and not restart.second._in_flight


async def test_requests_of_partitions_given_away_are_forgotten(
    settings: Settings, clock: ManualClock
) -> None:
    job = dispatcher_for(settings, Recorder(), clock)
    job.observe_heartbeat(heartbeat(capacity=8))
    loop = asyncio.create_task(job.run())
    assert await (await admit(job, request(1))) is Outcome.FORWARDED
    assert await job.take_partitions({0, 1}) == 0  # held already
    assert set(job._in_flight) == {("t", "r1")}
    # Partition 0 went to another instance, which adopts r1 (and gets its usage).
    assert await job.take_partitions({1}) == 0
    assert not job._in_flight and job.metrics.num_in_flight == 0
    loop.cancel()


async def test_a_request_refused_when_sent_again_is_done_and_never_adopted(
    settings: Settings, clock: ManualClock
) -> None:
    recorder, ledger = Recorder(), MemoryLedger()
    first = dispatcher_for(settings, recorder, clock, ledger)
    first.observe_heartbeat(heartbeat(capacity=8))
    loop = asyncio.create_task(first.run())
    assert await (await admit(first, request(1))) is Outcome.FORWARDED
    clock.advance(0.31)  # its only worker is lost: an interactive request is refused
    await until(lambda: any(c.error for c in recorder.chunks_on(REPLIES)))
    (refusal,) = [c for c in recorder.chunks_on(REPLIES) if c.error]
    assert refusal.error is not None and refusal.error.code == "no_worker"
    entry = ledger.get("t", "r1")
    assert entry is not None and entry.state is State.DONE
    loop.cancel()
    assert await dispatcher_for(settings, recorder, clock, ledger).adopt({0}) == 0
