"""stream_jobs.faust_drain: Faust's ``wait_first`` with its first coroutine run at once.
A delivery that never waits ends without a task; one that waits is interrupted by a
suspended flow, a stop or a crash exactly as Faust's own ``wait_first`` interrupts it."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from mode import Service

from stream_jobs import faust_drain
from stream_jobs.faust_drain import Resumed, wait_first


class Drainer(Service):
    """Stands for Faust's consumer: a service whose ``wait_first`` delivers records."""


async def started() -> Drainer:
    service = Drainer()
    await service.start()
    return service


async def test_a_delivery_that_never_waits_ends_in_the_callers_task() -> None:
    service = await started()
    tasks_before = len(asyncio.all_tasks())
    ran_in: list[asyncio.Task[Any] | None] = []
    flow = asyncio.Event()

    async def deliver(n: int) -> int:
        ran_in.append(asyncio.current_task())
        return n * 2

    flow_wait = flow.wait()
    result = await wait_first(service, deliver(21), flow_wait)
    # The flow's wait never ran, and is closed (no "never awaited" warning).
    assert inspect.getcoroutinestate(flow_wait) == inspect.CORO_CLOSED
    assert result.done == [result.done[0]] and result.results == [42]
    assert not result.stopped
    assert ran_in == [asyncio.current_task()]
    assert len(asyncio.all_tasks()) == tasks_before
    await service.stop()


async def test_a_delivery_that_waits_goes_on_from_where_it_stopped() -> None:
    service = await started()
    gate, flow = asyncio.Event(), asyncio.Event()
    steps: list[str] = []

    async def deliver() -> str:
        steps.append("decoded")
        await gate.wait()
        steps.append("queued")
        await asyncio.sleep(0)
        return "delivered"

    waiting = asyncio.ensure_future(wait_first(service, deliver(), flow.wait()))
    await asyncio.sleep(0.01)
    assert steps == ["decoded"] and not waiting.done()
    gate.set()
    result = await waiting
    assert result.results == ["delivered"] and steps == ["decoded", "queued"]
    await service.stop()


async def test_a_suspended_flow_interrupts_a_waiting_delivery_as_faust_does() -> None:
    service = await started()
    flow = asyncio.Event()
    ended: list[str] = []

    async def deliver() -> None:
        try:
            await asyncio.Event().wait()  # a full agent queue: never frees
        finally:
            ended.append("cancelled")

    waiting = asyncio.ensure_future(wait_first(service, deliver(), flow.wait()))
    await asyncio.sleep(0.01)
    flow.set()
    result = await asyncio.wait_for(waiting, 1)
    assert result.results == [True]  # the flow's wait won
    await asyncio.sleep(0)
    assert ended == ["cancelled"]
    await service.stop()


async def test_a_stop_interrupts_a_waiting_delivery() -> None:
    service = await started()

    async def deliver() -> None:
        await asyncio.Event().wait()

    waiting = asyncio.ensure_future(wait_first(service, deliver(), asyncio.Event().wait()))
    await asyncio.sleep(0.01)
    await service.stop()
    assert (await asyncio.wait_for(waiting, 1)).stopped


async def test_errors_reach_the_caller_before_and_after_a_wait() -> None:
    service = await started()
    gate = asyncio.Event()

    async def at_once() -> None:
        raise ValueError("undecodable")

    async def later() -> None:
        await gate.wait()
        raise KeyError("gone")

    with pytest.raises(ValueError, match="undecodable"):
        await wait_first(service, at_once(), asyncio.Event().wait())
    waiting = asyncio.ensure_future(wait_first(service, later(), asyncio.Event().wait()))
    await asyncio.sleep(0.01)
    gate.set()
    with pytest.raises(KeyError):
        await waiting
    await service.stop()


async def test_anything_but_a_coroutine_first_goes_to_faust_as_it_ships() -> None:
    service = await started()
    ready = asyncio.Event()
    ready.set()
    assert (await wait_first(service, ready)).results == [True]
    await service.stop()
    stopped = await wait_first(service, asyncio.sleep(0, "late"))
    assert stopped.stopped  # a stopped service: Faust's answer, not the coroutine's


async def test_resumed_passes_what_its_task_throws_through_to_the_coroutine() -> None:
    seen: list[str] = []
    waited_on: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def deliver() -> str:
        try:
            await waited_on
        except ValueError as exc:
            seen.append(str(exc))
            return "handled"
        return "not thrown"

    coro = deliver()
    steps = Resumed(coro, coro.send(None)).__await__()
    assert steps.send(None) is waited_on  # what the coroutine waits for, passed up
    with pytest.raises(StopIteration) as ended:
        steps.throw(ValueError("thrown by its task"))
    assert ended.value.value == "handled" and seen == ["thrown by its task"]
    waited_on.cancel()


def test_install_is_idempotent_and_undone() -> None:
    from faust.transport.consumer import Consumer

    shipped = Consumer.wait_first
    faust_drain.install()
    faust_drain.install()
    try:
        assert Consumer.wait_first is wait_first
    finally:
        faust_drain.uninstall()
    assert Consumer.wait_first is shipped
