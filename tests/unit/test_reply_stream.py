"""``ReplyStream``: a request's chunks in seq order, a caller's timeout that leaves the
stream as it was, read-backs on a gap and on silence, and the stream's own timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from producers.inbox import Inbox
from producers.reply_stream import ReplyStream, TokenbusTimeout
from schemas import FinishReason
from tokenbus.chunks import Chunk


def chunk(seq: int, *, last: bool = False) -> Chunk:
    return Chunk(
        "r1",
        "acme",
        seq,
        text=f"t{seq}",
        num_tokens=1,
        finish_reason=FinishReason.STOP if last else None,
    )


class ReadBacks:
    """Records each read-back's ``expected``, and adds what the topic is made to hold."""

    def __init__(self, holds: list[Chunk] | None = None) -> None:
        self.holds = holds or []
        self.calls: list[tuple[float, int]] = []

    async def __call__(self, expected: int, inbox: Inbox[Chunk], ahead: dict[int, Chunk]) -> None:
        self.calls.append((time.monotonic(), expected))
        for c in self.holds:
            if c.seq >= expected:
                ahead.setdefault(c.seq, c)


def stream(
    read_back: ReadBacks, *, quiet_s: float = 10.0, timeout_s: float = 30.0
) -> tuple[ReplyStream, Inbox[Chunk], list[ReplyStream]]:
    inbox: Inbox[Chunk] = Inbox()
    closed: list[ReplyStream] = []
    replies = ReplyStream(
        "r1",
        inbox,
        read_back=read_back,
        quiet_s=quiet_s,
        timeout_s=timeout_s,
        on_close=closed.append,
    )
    return replies, inbox, closed


async def test_chunks_come_in_seq_order_once_each() -> None:
    replies, inbox, _ = stream(ReadBacks())
    for seq in (0, 0, 2, 1, 1, 3):  # a redelivery, one ahead of its turn
        inbox.put(chunk(seq, last=seq == 3))
    seqs = []
    while (c := replies.ready()) is not None:
        seqs.append(c.seq)
    assert seqs == [0, 1, 2, 3]
    assert replies.num_delivered == 4
    assert replies.last is not None and replies.last.is_last


async def test_a_callers_timeout_returns_none_and_the_stream_goes_on() -> None:
    replies, inbox, _ = stream(ReadBacks())
    started = time.monotonic()
    assert await replies.get(0.05) is None
    assert 0.04 <= time.monotonic() - started < 1.0
    asyncio.get_running_loop().call_later(0.02, inbox.put, chunk(0))
    got = await replies.get(5.0)
    assert got is not None and got.seq == 0
    inbox.put(chunk(1, last=True))
    assert (await replies.next()).seq == 1


async def test_the_streams_timeout_counts_silence_across_the_callers_timeouts() -> None:
    # A bridge that wakes every 50 ms for its heartbeat must not keep a dead stream alive.
    replies, _, _ = stream(ReadBacks(), quiet_s=10.0, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(TokenbusTimeout):
        async with asyncio.timeout(3):  # a stream kept alive by them would fail here
            while True:
                assert await replies.get(0.05) is None
    assert 0.28 <= time.monotonic() - started < 1.5


async def test_a_chunk_resets_the_silence() -> None:
    replies, inbox, _ = stream(ReadBacks(), quiet_s=10.0, timeout_s=0.3)
    loop = asyncio.get_running_loop()
    for seq in range(3):  # one every 0.2 s: never 0.3 s of silence
        loop.call_later(0.2, inbox.put, chunk(seq))
        got = await replies.get()
        assert got is not None and got.seq == seq
    with pytest.raises(TokenbusTimeout):
        await replies.get()


async def test_silence_reads_back_each_quiet_spell_twice_as_long() -> None:
    read_back = ReadBacks()
    replies, _, _ = stream(read_back, quiet_s=0.1, timeout_s=0.6)
    started = time.monotonic()
    with pytest.raises(TokenbusTimeout):
        await replies.get()
    at = [round(t - started, 2) for t, _ in read_back.calls]
    assert [e for _, e in read_back.calls] == [0, 0]
    assert 0.09 <= at[0] < 0.2 and 0.28 <= at[1] < 0.45  # after 0.1 s, then 0.2 s more


async def test_what_a_read_back_finds_is_delivered() -> None:
    read_back = ReadBacks(holds=[chunk(0), chunk(1, last=True)])
    replies, _, _ = stream(read_back, quiet_s=0.05)
    assert (await replies.next()).seq == 0
    assert (await replies.next()).seq == 1
    assert len(read_back.calls) == 1


async def test_a_gap_is_read_back_at_once_and_once() -> None:
    read_back = ReadBacks()
    replies, inbox, _ = stream(read_back, quiet_s=10.0)
    inbox.put(chunk(1))  # seq 0 went missing
    assert await replies.get(0.05) is None
    assert [e for _, e in read_back.calls] == [0]
    assert await replies.get(0.05) is None  # the same gap: not read back again
    assert len(read_back.calls) == 1
    inbox.put(chunk(0))
    assert [(await replies.next()).seq, (await replies.next()).seq] == [0, 1]


async def test_close_forgets_the_stream_once() -> None:
    replies, _, closed = stream(ReadBacks())
    replies.close()
    replies.close()
    assert closed == [replies] and replies.closed
