"""stream_jobs.answer_order: answers to one request id go out in the order their turns
were taken, whatever each one waits for."""

from __future__ import annotations

import asyncio

import pytest

from stream_jobs.answer_order import AnswerOrder, Turn

A = ("acme", "r1")
B = ("acme", "r2")


async def test_answers_to_one_id_go_in_the_order_their_turns_were_taken() -> None:
    order = AnswerOrder()
    sent: list[int] = []
    first_may_send = asyncio.Event()

    async def answer(turn: Turn, seq: int, wait: asyncio.Event | None = None) -> None:
        async with turn:
            if wait is not None:
                await wait.wait()  # as for the producer's metadata
            sent.append(seq)

    first = asyncio.create_task(answer(order.take(A), 5, first_may_send))
    second = asyncio.create_task(answer(order.take(A), 6))
    other = asyncio.create_task(answer(order.take(B), 0))
    await asyncio.sleep(0.01)
    assert sent == [0]  # another id does not wait; the second answer to A does
    first_may_send.set()
    await asyncio.gather(first, second, other)
    assert sent == [0, 5, 6]
    assert len(order) == 0  # nothing left behind


async def test_a_turn_cancelled_while_it_waits_lets_the_next_go() -> None:
    order = AnswerOrder()
    held = order.take(A)
    await held.__aenter__()
    sent: list[int] = []

    async def answer(seq: int) -> None:
        async with order.take(A):
            sent.append(seq)

    cancelled = asyncio.create_task(answer(6))
    last = asyncio.create_task(answer(7))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not held.ended.done()  # the one it waited for is not cancelled with it
    await asyncio.sleep(0.01)
    assert sent == []  # nor does the next overtake it
    await held.__aexit__(None, None, None)
    await last
    assert sent == [7]
    assert len(order) == 0


async def test_a_turn_never_entered_must_be_ended_and_ending_twice_is_harmless() -> None:
    order = AnswerOrder()
    skipped = order.take(A)
    after = asyncio.create_task(asyncio.wait_for(order.take(A).__aenter__(), 0.05))
    with pytest.raises(TimeoutError):
        await after  # waits for the turn before it, for good if nobody ends it
    skipped.end()
    skipped.end()
    await asyncio.wait_for(order.take(A).__aenter__(), 1)
    assert len(order) == 1  # that one is not ended
