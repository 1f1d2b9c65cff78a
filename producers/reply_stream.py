"""``ReplyStream``: one request's chunks in seq order, read with a timeout that never
breaks the stream.

# reply reader --> Inbox (chunks as they arrive) --> ReplyStream.ready() / get(timeout_s)
#   --> the caller: ``TokenbusClient.stream()``'s generator, or the bridge's handler

A redelivered chunk (a seq already delivered) is dropped. A chunk ahead of its seq waits
until the ones before it come; should they not (a gap), or should nothing come for the
stream's quiet spell, the stream reads its reply topic back from the request's start
(``read_back``) and delivers what the reply reader had not, rather than hang. Each
further quiet spell is twice as long as the one before; ``client_timeout_s`` of silence
ends the stream with ``TokenbusTimeout``.

A caller's own timeout (``get(timeout_s)``: the bridge's first-chunk wait, its
heartbeats) returns None and leaves the stream as it was, so a reader that must also do
something else while it waits needs no task of its own (the bridge once read each
stream through a task that fed a second inbox: a loop turn more for every token). Its
only I/O is the inbox and ``read_back``; its clock is the event loop's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from producers.inbox import EARLY_S, Inbox
from tokenbus.chunks import Chunk


class TokenbusTimeout(TimeoutError):
    """No chunk arrived for ``client_timeout_s``."""


ReadBack = Callable[[int, Inbox[Chunk], dict[int, Chunk]], Awaitable[None]]
"""``(expected, inbox, ahead)``: adds to ``ahead`` the chunks from seq ``expected`` on that
the reply topic holds and the inbox had not delivered (``TokenbusClient._read_back``)."""


class ReplyStream:
    __slots__ = (
        "_ahead",
        "_chunks",
        "_expected",
        "_heard",
        "_heard_at",
        "_inbox",
        "_last",
        "_loop",
        "_on_close",
        "_quiet_s",
        "_read_back",
        "_read_back_at",
        "_read_back_for",
        "_timeout_s",
        "closed",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        inbox: Inbox[Chunk],
        *,
        read_back: ReadBack,
        quiet_s: float,
        timeout_s: float,
        on_close: Callable[[ReplyStream], None] = lambda stream: None,
    ) -> None:
        self.request_id = request_id
        self.closed = False
        self._inbox = inbox
        self._chunks = inbox.items
        self._read_back = read_back
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._expected = 0
        self._ahead: dict[int, Chunk] = {}  # received, not yet delivered: seq >= expected
        self._read_back_for = -1  # the seq a gap was last read back for
        self._last: Chunk | None = None
        self._quiet_s = quiet_s
        self._timeout_s = timeout_s
        self._heard = False  # items were taken from the inbox since the last get()
        self._heard_at = self._loop.time()
        self._read_back_at = self._heard_at + quiet_s

    @property
    def num_delivered(self) -> int:
        return self._expected

    @property
    def last(self) -> Chunk | None:
        """The chunk delivered last (the one with finish_reason, once the stream ended)."""
        return self._last

    def ready(self) -> Chunk | None:
        """The next chunk if it is here already, without waiting; None otherwise."""
        chunks, ahead = self._chunks, self._ahead
        if chunks:
            self._heard = True
            while chunks:
                chunk = chunks.popleft()
                if chunk.seq == self._expected and not ahead:  # the common case
                    return self._deliver(chunk)
                if chunk.seq >= self._expected:  # below: redelivered, already delivered
                    ahead.setdefault(chunk.seq, chunk)
        if self._expected in ahead:
            return self._deliver(ahead.pop(self._expected))
        return None

    async def get(self, timeout_s: float | None = None) -> Chunk | None:
        """The next chunk; None if none came within ``timeout_s`` (None: no limit), and
        the stream goes on. Raises ``TokenbusTimeout`` once the stream has heard nothing
        for ``client_timeout_s``."""
        chunk = self.ready()
        if chunk is not None:
            return chunk
        loop = self._loop
        give_up_at = None if timeout_s is None else loop.time() + timeout_s
        while True:
            now = loop.time()
            if self._heard:  # chunks came since the silence was last measured
                self._heard = False
                self._heard_at, self._read_back_at = now, now + self._quiet_s
            late = now + EARLY_S  # a timer may fire that much early (producers.inbox)
            if self._ahead and self._read_back_for != self._expected:
                self._read_back_for = self._expected  # chunks before these went missing
                await self._read_back(self._expected, self._inbox, self._ahead)
            elif late >= self._heard_at + self._timeout_s:
                raise TokenbusTimeout(f"no reply to {self.request_id} for {self._timeout_s:.0f} s")
            elif late >= self._read_back_at:
                self._quiet_s *= 2
                await self._read_back(self._expected, self._inbox, self._ahead)
                self._read_back_at = loop.time() + self._quiet_s
            elif give_up_at is not None and late >= give_up_at:
                return None
            else:
                deadline = min(self._read_back_at, self._heard_at + self._timeout_s)
                if give_up_at is not None:
                    deadline = min(deadline, give_up_at)
                await self._inbox.wait(deadline - now)  # what came, ready() takes
            chunk = self.ready()
            if chunk is not None:
                return chunk

    async def next(self) -> Chunk:
        """The next chunk, however long it takes (up to ``client_timeout_s`` of silence)."""
        chunk = await self.get()
        assert chunk is not None  # no timeout of the caller's
        return chunk

    def close(self) -> None:
        """Stops collecting the request's chunks; idempotent."""
        if not self.closed:
            self.closed = True
            self._inbox.close()
            self._on_close(self)

    def _deliver(self, chunk: Chunk) -> Chunk:
        self._expected += 1
        self._last = chunk
        return chunk
