"""Batch lines at the job: class 2 only, charged to the tenant's batch budget, counted,
and the load reports batch pacers read."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from schemas import (
    InferenceRequest,
    SamplingParams,
    UsageEvent,
    UsageStatus,
    WorkItem,
    decode,
    encode,
)
from stream_jobs.dispatcher import Dispatcher, Outcome
from stream_jobs.metrics import job_registry
from tests.unit.fakes import TOPICS, ManualClock, Recorder, reply_topic
from tests.unit.test_dispatcher import admit, dispatcher_for, heartbeat
from tokenbus.config import Settings

TENANTS = """
[tenants.acme]
tpm = 40
batch_tpm = 60

[tenants.beta]
batch_tpm = 60

[tenants.gamma]
"""


def line(n: int, tenant: str = "acme", *, priority: int = 2, batch: str = "b1") -> InferenceRequest:
    """A batch line of 24 tokens: a 2-token prompt and 22 out."""
    return InferenceRequest(
        request_id=f"{batch}.{n}",
        tenant_id=tenant,
        priority=priority,
        model="m",
        prompt="x",
        sampling=SamplingParams(max_tokens=22),
        reply_to=reply_topic(tenant),
        batch_id=batch,
    )


def interactive(n: int, tenant: str = "acme") -> InferenceRequest:
    return InferenceRequest(
        request_id=f"i{n}",
        tenant_id=tenant,
        model="m",
        prompt="x",
        sampling=SamplingParams(max_tokens=22),
        reply_to=reply_topic(tenant),
    )


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    return Settings(home=tmp_path, tenants_file=tenants, default_batch_tpm=30)


@pytest.fixture
async def dispatcher(settings: Settings, recorder: Recorder) -> Dispatcher:
    dispatcher = dispatcher_for(settings, recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=50))
    return dispatcher


async def outcomes(dispatcher: Dispatcher, requests: list[InferenceRequest]) -> list[Outcome]:
    return [await (await admit(dispatcher, r)) for r in requests]


def errors(recorder: Recorder, tenant: str) -> dict[str, tuple[str, str, float | None]]:
    return {
        c.request_id: (c.error.code, c.error.message, c.error.retry_after_s)
        for c in recorder.chunks_on(reply_topic(tenant))
        if c.error is not None
    }


def counters(dispatcher: Dispatcher) -> dict[str, float]:
    text = generate_latest(job_registry(lambda: dispatcher.metrics)).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if "batch" in sample.name
    }


async def test_a_batch_id_below_class_2_is_refused_and_never_runs(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    loop = asyncio.create_task(dispatcher.run())
    refused = [line(0, priority=1), line(1, priority=0)]

    assert await outcomes(dispatcher, refused) == [Outcome.REFUSED, Outcome.REFUSED]
    assert await outcomes(dispatcher, [line(2)]) == [Outcome.FORWARDED]

    found = errors(recorder, "acme")
    assert {rid: code for rid, (code, _, _) in found.items()} == {
        "b1.0": "invalid_request",
        "b1.1": "invalid_request",
    }
    assert "batch_id is for batch lines, which run at priority 2" in found["b1.0"][1]
    [forwarded] = [decode(WorkItem, v) for v in recorder.on("tokenbus.worker.w")]
    assert (forwarded.request_id, forwarded.batch_id, forwarded.priority) == ("b1.2", "b1", 2)
    usage = [decode(UsageEvent, v) for v in recorder.on(TOPICS.usage)]
    assert {(u.request_id, u.status, u.batch_id) for u in usage} == {
        ("b1.0", "rejected", "b1"),
        ("b1.1", "rejected", "b1"),
    }  # refused: billed nothing, under its batch
    assert counters(dispatcher)["tokenbus_job_num_batch_rejected_invalid_total"] == 2
    loop.cancel()


async def test_a_tenant_whose_class_is_2_may_send_lines_at_any_priority(
    recorder: Recorder, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[tenants.bulk]\npriority_class = 2\n")
    dispatcher = dispatcher_for(Settings(home=tmp_path, tenants_file=tenants), recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=50))
    loop = asyncio.create_task(dispatcher.run())

    # Its class is 2 whatever it asks: the line runs as batch work.
    assert await outcomes(dispatcher, [line(0, "bulk", priority=1)]) == [Outcome.FORWARDED]
    [forwarded] = [decode(WorkItem, v) for v in recorder.on("tokenbus.worker.w")]
    assert forwarded.priority == 2
    loop.cancel()


async def test_batch_lines_spend_the_batch_budget_and_never_the_interactive_one(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    loop = asyncio.create_task(dispatcher.run())

    # acme: tpm 40, batch_tpm 60. Two lines fit its batch minute (48 of 60), a third not.
    assert await outcomes(dispatcher, [line(n) for n in range(3)]) == [
        Outcome.FORWARDED,
        Outcome.FORWARDED,
        Outcome.REFUSED,
    ]
    code, message, retry_after_s = errors(recorder, "acme")["b1.2"]
    assert code == "quota_exceeded"
    assert "(batch budget)" in message and "48 of 60 tokens" in message
    assert retry_after_s is not None and 59 < retry_after_s <= 60
    # Its interactive minute is untouched by the 48 batch tokens: one request fits its 40.
    assert await outcomes(dispatcher, [interactive(0)]) == [Outcome.FORWARDED]
    # Another tenant's batch has a budget of its own.
    assert await outcomes(dispatcher, [line(n, "beta") for n in range(2)]) == [
        Outcome.FORWARDED,
        Outcome.FORWARDED,
    ]
    refusal = [c for c in recorder.chunks_on(reply_topic("acme")) if c.request_id == "b1.2"]
    assert refusal[0].error is not None and refusal[0].error.num_limit == 60
    assert counters(dispatcher) == {
        "tokenbus_job_num_batch_admitted_total": 4.0,
        "tokenbus_job_num_batch_rejected_quota_total": 1.0,
        "tokenbus_job_num_batch_rejected_invalid_total": 0.0,
    }
    loop.cancel()


async def test_the_tenant_s_request_rate_does_not_bind_its_batch_lines(
    recorder: Recorder, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[tenants.slow]\nrpm = 2\n")
    dispatcher = dispatcher_for(Settings(home=tmp_path, tenants_file=tenants), recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=50))
    loop = asyncio.create_task(dispatcher.run())

    # Two interactive requests a minute, but its batch lines are held by tokens alone.
    lines = [line(n, "slow") for n in range(10)]
    assert await outcomes(dispatcher, lines) == [Outcome.FORWARDED] * 10
    assert await outcomes(dispatcher, [interactive(n, "slow") for n in range(3)]) == [
        Outcome.FORWARDED,
        Outcome.FORWARDED,
        Outcome.REFUSED,
    ]
    loop.cancel()


async def test_a_tenant_without_batch_tpm_gets_the_default_batch_budget(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    loop = asyncio.create_task(dispatcher.run())

    # gamma sets none: Settings.default_batch_tpm (30) holds one 24-token line a minute.
    assert await outcomes(dispatcher, [line(0, "gamma"), line(1, "gamma")]) == [
        Outcome.FORWARDED,
        Outcome.REFUSED,
    ]
    assert errors(recorder, "gamma")["b1.1"][0] == "quota_exceeded"
    loop.cancel()


async def test_a_line_s_usage_settles_the_batch_window(
    dispatcher: Dispatcher, recorder: Recorder
) -> None:
    loop = asyncio.create_task(dispatcher.run())
    assert await outcomes(dispatcher, [line(0), line(1)]) == [Outcome.FORWARDED] * 2

    # b1.0 used 4 of its 24 tokens: 20 come back to the batch window, where a third fits.
    dispatcher.observe_usage(
        encode(
            UsageEvent(
                request_id="b1.0",
                session_id="b1.0",
                tenant_id="acme",
                model="m",
                status=UsageStatus.OK,
                priority=2,
                num_prompt_tokens=2,
                num_completion_tokens=2,
                created_at=datetime.now(UTC),
                batch_id="b1",
            )
        )
    )
    assert await outcomes(dispatcher, [line(2)]) == [Outcome.FORWARDED]
    loop.cancel()


async def test_load_reports_show_interactive_waits_and_batch_lines_per_model(
    recorder: Recorder, tmp_path: Path
) -> None:
    settings = Settings(
        home=tmp_path,
        vip_reserve=0.0,
        default_priority_class=0,
        tier_cap_above=9.0,  # nothing shed or capped: the last line waits for a seat
        tier_shed_above=10.0,
    )
    dispatcher = dispatcher_for(settings, recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=3, running=2))
    loop = asyncio.create_task(dispatcher.run())
    running = [line(0, "t"), line(1, "t"), interactive(0, "t")]
    assert await outcomes(dispatcher, running) == [Outcome.FORWARDED] * 3
    waiting = [await admit(dispatcher, interactive(1, "t")), await admit(dispatcher, line(2, "t"))]
    await asyncio.sleep(0.05)

    [report] = dispatcher.load_reports("job-1")

    assert (report.model, report.instance) == ("m", "job-1")
    assert report.num_waiting_by_class == [0, 1, 1]
    assert (report.num_in_flight, report.num_batch_in_flight) == (3, 2)
    assert report.num_interactive_dispatched == 1  # i0; the lines are not interactive
    assert report.interactive_queue_ms_p99 is not None and report.interactive_queue_ms_p99 >= 0
    assert (report.num_workers, report.max_num_seqs, report.num_running) == (1, 3, 2)
    # The interval's samples were taken: the next report starts afresh.
    [later] = dispatcher.load_reports("job-1")
    assert later.num_interactive_dispatched == 0 and later.interactive_queue_ms_p99 is None
    for task in waiting:
        task.cancel()
    loop.cancel()


def line_done(n: int, tenant: str = "t", batch: str = "b1") -> bytes:
    return encode(
        UsageEvent(
            request_id=f"{batch}.{n}",
            session_id=f"{batch}.{n}",
            tenant_id=tenant,
            model="m",
            status=UsageStatus.OK,
            priority=2,
            num_prompt_tokens=2,
            num_completion_tokens=22,
            created_at=datetime.now(UTC),
            batch_id=batch,
        )
    )


async def test_the_first_interactive_request_seats_at_once_and_holds_class_2_to_its_cap(
    recorder: Recorder, tmp_path: Path
) -> None:
    clock = ManualClock()
    settings = Settings(
        home=tmp_path,
        vip_reserve=0.3,  # 10 seats: 7 for classes 1 and 2
        default_priority_class=0,
        tier_cap_above=9.0,  # nothing shed or capped: lines wait for a seat
        tier_shed_above=10.0,
        batch_yield_seats_per_worker=2,
        batch_yield_hold_s=3.0,
    )
    dispatcher = dispatcher_for(settings, recorder, clock)
    dispatcher.observe_heartbeat(heartbeat(capacity=10))
    loop = asyncio.create_task(dispatcher.run())
    # No interactive traffic: the batch fills every seat its class may.
    assert await outcomes(dispatcher, [line(n, "t") for n in range(7)]) == [Outcome.FORWARDED] * 7

    # The first interactive request does not wait for a line to end: five of the seven are
    # above the cap of 2, and the fleet has seats.
    assert await asyncio.wait_for(await admit(dispatcher, interactive(0, "t")), 1) is (
        Outcome.FORWARDED
    )
    # No new line goes out while the batch holds more than its cap.
    held = await admit(dispatcher, line(7, "t"))
    for n in range(5):
        dispatcher.observe_usage(line_done(n))
        await asyncio.sleep(0.06)  # a turn of the loop
    assert not held.done()  # two lines in flight: at the cap, not below it

    # Past the hold, but the interactive request still runs: the cap holds.
    clock.advance(5.0)
    dispatcher.observe_heartbeat(heartbeat(capacity=10))  # the worker stays live
    await asyncio.sleep(0.1)
    assert not held.done()

    # It ends, and no other came within the hold: the batch has its seats back.
    dispatcher.observe_usage(
        encode(
            UsageEvent(
                request_id="i0",
                session_id="i0",
                tenant_id="t",
                model="m",
                status=UsageStatus.OK,
                priority=1,
                num_prompt_tokens=2,
                num_completion_tokens=22,
                created_at=datetime.now(UTC),
            )
        )
    )
    assert await asyncio.wait_for(held, 1) is Outcome.FORWARDED
    order = [decode(WorkItem, v).request_id for v in recorder.on("tokenbus.worker.w")]
    assert order == [f"b1.{n}" for n in range(7)] + ["i0", "b1.7"]
    loop.cancel()


async def test_without_the_yield_an_interactive_request_waits_for_a_line_to_end(
    recorder: Recorder, tmp_path: Path
) -> None:
    settings = Settings(
        home=tmp_path,
        vip_reserve=0.3,
        default_priority_class=0,
        tier_cap_above=9.0,
        tier_shed_above=10.0,
        batch_yield_seats_per_worker=1000,  # at or above the seats: off
    )
    dispatcher = dispatcher_for(settings, recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=10))
    loop = asyncio.create_task(dispatcher.run())
    assert await outcomes(dispatcher, [line(n, "t") for n in range(7)]) == [Outcome.FORWARDED] * 7
    waiting = await admit(dispatcher, interactive(0, "t"))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    dispatcher.observe_heartbeat(heartbeat(capacity=10))
    dispatcher.observe_usage(line_done(0))
    assert await asyncio.wait_for(waiting, 1) is Outcome.FORWARDED
    loop.cancel()


async def test_a_batchs_own_lines_do_not_make_an_overload_tier_for_interactive_work(
    recorder: Recorder, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path, vip_reserve=0.0, default_priority_class=0)
    dispatcher = dispatcher_for(settings, recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    lines = [await admit(dispatcher, line(n, "t")) for n in range(12)]  # 300% of the seats
    await asyncio.sleep(0.05)
    assert dispatcher.metrics.num_waiting == 8 and dispatcher.metrics.tier == 0
    long = interactive(0, "t").model_copy(
        update={"priority": 1, "sampling": SamplingParams(max_tokens=1000)}
    )
    asked = await admit(dispatcher, long)
    await asyncio.sleep(0.05)
    assert dispatcher.metrics.tier == 0 and dispatcher.metrics.num_capped == 0
    # Interactive demand of its own still makes the tiers: 4 seats, 9 class 1 requests.
    more = [
        await admit(dispatcher, long.model_copy(update={"request_id": f"i{n}"}))
        for n in range(1, 9)
    ]
    await asyncio.sleep(0.05)
    assert dispatcher.metrics.tier >= 1 and dispatcher.metrics.num_capped > 0
    for task in [*lines, asked, *more]:
        task.cancel()
    loop.cancel()
    await asyncio.gather(loop, *lines, asked, *more, return_exceptions=True)


async def test_batch_lines_beyond_their_waiting_bound_are_turned_down_to_come_again(
    recorder: Recorder, tmp_path: Path
) -> None:
    settings = Settings(
        home=tmp_path, vip_reserve=0.0, default_priority_class=0, batch_max_waiting_per_seat=1.0
    )
    dispatcher = dispatcher_for(settings, recorder)
    dispatcher.observe_heartbeat(heartbeat(capacity=4))
    loop = asyncio.create_task(dispatcher.run())
    tasks = []
    for n in range(10):  # 4 run, 4 wait (one per seat), 2 come back later
        tasks.append(await admit(dispatcher, line(n, "t")))
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    turned_down = errors(recorder, "t")
    assert sorted(turned_down) == ["b1.8", "b1.9"]
    assert {code for code, _, _ in turned_down.values()} == {"overloaded"}
    assert all(retry == 1.0 for _, _, retry in turned_down.values())
    assert dispatcher.metrics.num_waiting == 4 and dispatcher.metrics.tier == 0
    # Interactive requests are not held by the batch's bound.
    assert await admit(dispatcher, interactive(0, "t")) is not None
    await asyncio.sleep(0.02)
    assert "i0" not in errors(recorder, "t")
    loop.cancel()
    for task in tasks:
        task.cancel()
    await asyncio.gather(loop, *tasks, return_exceptions=True)
