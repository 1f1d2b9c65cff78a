"""The ledger gets one record per admitted request, at its forward: until then the
request the dispatcher holds is its ADMITTED entry, and a restart before the forward
admits the redelivery again without charging it twice."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from schemas import InferenceRequest, SamplingParams, WorkerStatus, WorkItem, decode, encode
from stream_jobs.dispatcher import Admitted, Dispatcher, Outcome
from stream_jobs.ledger import State
from tests.unit.fakes import (
    ManualClock,
    MemoryLedger,
    MemoryWindowStore,
    Recorder,
    Replies,
    bus_authenticator,
    reply_topic,
    service_headers,
)
from tokenbus.config import Settings

WORKER = "w-topic"


def request(reply_to: str) -> bytes:
    return encode(
        InferenceRequest(
            request_id="r1",
            tenant_id="t",
            model="m",
            prompt="hello",
            sampling=SamplingParams(max_tokens=10),
            reply_to=reply_to,
        )
    )


def heartbeat() -> bytes:
    return encode(
        WorkerStatus(
            worker_id="w",
            model="m",
            request_topic=WORKER,
            max_num_seqs=8,
            num_running=0,
            incarnation="run-1",
        )
    )


def make(
    settings: Settings, recorder: Recorder, store: MemoryWindowStore, ledger: MemoryLedger
) -> Dispatcher:
    dispatcher = Dispatcher(
        settings,
        recorder,
        store,
        Replies(recorder),
        ledger,
        authenticator=bus_authenticator(settings.tenant_directory()),
        clock=ManualClock(),
    )
    dispatcher.observe_heartbeat(heartbeat())
    return dispatcher


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, worker_dead_after_s=0.3, vip_reserve=0.0)


async def admit(dispatcher: Dispatcher, reply_to: str) -> Outcome | Admitted:
    return await dispatcher.admit("p", 0, 0, b"t", request(reply_to), service_headers("t"))


async def test_a_held_request_is_its_admitted_entry_and_the_table_gets_its_forward(
    settings: Settings,
) -> None:
    recorder, ledger = Recorder(), MemoryLedger()
    dispatcher = make(settings, recorder, MemoryWindowStore(), ledger)
    mine, other = reply_topic("t"), reply_topic("t", "c2")
    admitted = await admit(dispatcher, mine)
    assert isinstance(admitted, Admitted)
    assert ledger.entries == {}  # no record before its forward
    # Held here: a copy for its own reply topic changes nothing, one for another is
    # answered duplicate_request, as an ADMITTED entry in the table would have it.
    assert await admit(dispatcher, mine) is Outcome.DUPLICATE
    assert not recorder.chunks_on(mine)
    assert await admit(dispatcher, other) is Outcome.DUPLICATE
    (chunk,) = recorder.chunks_on(other)
    assert chunk.error is not None and chunk.error.code == "duplicate_request"
    assert ledger.entries == {}

    loop = asyncio.create_task(dispatcher.run())
    assert await asyncio.wait_for(dispatcher.finish(admitted), 2) is Outcome.FORWARDED
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    (entry,) = ledger.entries.values()
    assert entry.state is State.FORWARDED and entry.reply_to == mine
    (forwarded,) = [decode(WorkItem, v) for v in recorder.on(WORKER)]
    assert forwarded.request_id == "r1"


async def test_a_restart_before_the_forward_runs_the_redelivery_once_charged_once(
    settings: Settings,
) -> None:
    recorder, store, ledger = Recorder(), MemoryWindowStore(), MemoryLedger()
    before = make(settings, recorder, store, ledger)
    assert isinstance(await admit(before, reply_topic("t")), Admitted)
    charged = store.load("t").used()
    assert charged[1] == 1
    # The job dies before the forward: its event was not acked, and is redelivered to
    # a new instance with the same tables (window, ledger) and nothing in memory.
    after = make(settings, recorder, store, ledger)
    loop = asyncio.create_task(after.run())
    handled = after.handle_request("p", 0, 0, b"t", request(reply_topic("t")), service_headers("t"))
    assert await asyncio.wait_for(handled, 2) is Outcome.FORWARDED
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    assert store.load("t").used() == charged  # the reservation held: not charged again
    assert len(recorder.on(WORKER)) == 1
    (entry,) = ledger.entries.values()
    assert entry.state is State.FORWARDED
    # Forwarded: one more copy is the same stream, not a second run.
    assert await admit(after, reply_topic("t")) is Outcome.DUPLICATE
    assert len(recorder.on(WORKER)) == 1
