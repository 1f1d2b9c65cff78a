from __future__ import annotations

import asyncio

import pytest

from tokenbus.loops import until_stopped


async def forever() -> None:
    await asyncio.Event().wait()


async def test_stop_cancels_the_tasks_and_returns() -> None:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(forever()), asyncio.create_task(forever())]
    waiting = asyncio.create_task(until_stopped(stop, tasks))
    await asyncio.sleep(0)
    assert not waiting.done()
    stop.set()
    await asyncio.wait_for(waiting, 1)
    assert all(task.cancelled() for task in tasks)


async def test_a_task_that_fails_raises_and_the_others_are_cancelled() -> None:
    async def fail() -> None:
        raise RuntimeError("the loop broke")

    other = asyncio.create_task(forever())
    with pytest.raises(RuntimeError, match="the loop broke"):
        await asyncio.wait_for(
            until_stopped(asyncio.Event(), [asyncio.create_task(fail()), other]), 1
        )
    assert other.cancelled()


async def test_a_task_that_ends_ends_the_wait() -> None:
    other = asyncio.create_task(forever())
    done = asyncio.create_task(asyncio.sleep(0))
    await asyncio.wait_for(until_stopped(asyncio.Event(), [done, other]), 1)
    assert done.done() and not done.cancelled() and other.cancelled()
