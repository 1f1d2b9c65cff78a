"""The one-reader mailbox: wakes on a put, times out on silence, one timer per spell."""

from __future__ import annotations

import asyncio

import pytest

from producers.inbox import Inbox


def elapsed_since(start: float) -> float:
    return asyncio.get_running_loop().time() - start


async def test_an_item_already_there_is_taken_without_waiting() -> None:
    inbox: Inbox[int] = Inbox()
    inbox.put(1)
    assert await inbox.wait(0) is True
    assert inbox.items.popleft() == 1


async def test_a_put_wakes_the_waiting_reader() -> None:
    inbox: Inbox[str] = Inbox()
    waiting = asyncio.create_task(inbox.wait(5))
    await asyncio.sleep(0)
    inbox.put("a")
    assert await waiting is True and list(inbox.items) == ["a"]


async def test_silence_for_the_timeout_returns_false() -> None:
    inbox: Inbox[int] = Inbox()
    start = asyncio.get_running_loop().time()
    assert await inbox.wait(0.05) is False
    assert 0.045 <= elapsed_since(start) < 0.5


async def test_no_timeout_waits_for_the_item() -> None:
    inbox: Inbox[int] = Inbox()
    waiting = asyncio.create_task(inbox.wait(None))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    inbox.put(1)
    assert await waiting is True


async def test_a_timer_armed_for_an_earlier_wait_does_not_cut_a_later_one_short() -> None:
    inbox: Inbox[int] = Inbox()
    first = asyncio.create_task(inbox.wait(0.05))
    await asyncio.sleep(0.01)
    inbox.put(1)
    assert await first is True
    inbox.items.clear()
    start = asyncio.get_running_loop().time()
    assert await inbox.wait(0.1) is False  # the 0.05 timer fires first and re-arms
    assert elapsed_since(start) >= 0.095


async def test_a_shorter_wait_after_a_longer_one_gets_its_own_deadline() -> None:
    inbox: Inbox[int] = Inbox()
    first = asyncio.create_task(inbox.wait(10))
    await asyncio.sleep(0)
    inbox.put(1)
    assert await first is True
    inbox.items.clear()
    start = asyncio.get_running_loop().time()
    assert await inbox.wait(0.05) is False
    assert elapsed_since(start) < 1


async def test_many_waits_in_one_quiet_spell_arm_one_timer() -> None:
    armed: list[float] = []

    class Counting(Inbox[int]):
        def _arm(self, at: float) -> None:
            armed.append(at)
            super()._arm(at)

    inbox = Counting()
    for n in range(100):
        waiting = asyncio.create_task(inbox.wait(5))
        await asyncio.sleep(0)
        inbox.put(n)
        assert await waiting is True
        inbox.items.clear()
    assert len(armed) == 1
    inbox.close()


async def test_a_cancelled_wait_leaves_the_inbox_usable() -> None:
    inbox: Inbox[int] = Inbox()
    waiting = asyncio.create_task(inbox.wait(5))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    inbox.put(7)
    assert await inbox.wait(0.01) is True and inbox.items.popleft() == 7
    assert await inbox.wait(0.01) is False
