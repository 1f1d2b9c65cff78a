"""A Server-Sent Events response that knows when its client went away.

Starlette's StreamingResponse stops quietly on a disconnect; the bridge must also
cancel the request on the bus, at once, because the worker keeps generating (and
billing) until it hears. So this response runs the event pump and a disconnect
listener side by side, and on a disconnect before the last event it calls
``on_disconnect`` shielded from the cancellation that is tearing the stream down.

Its ``WriteClock`` holds when it began writing the latest event, so a span can end where
that event's bytes left the bridge rather than where the event generator was resumed:
after a write the process that was woken (the caller) may have the core first, and the
generator's own clock then reads late by as long as the bridge waited for it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class WriteClock:
    """The wall-clock ns at which the response began writing its latest event (0 until
    the first); read by the event generator when the response resumes it."""

    __slots__ = ("writing_ns",)

    def __init__(self) -> None:
        self.writing_ns = 0


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        *,
        headers: Mapping[str, str],
        on_disconnect: Callable[[], Awaitable[None]],
        clock: WriteClock | None = None,
    ) -> None:
        self._events = events
        self._on_disconnect = on_disconnect
        self.clock = clock or WriteClock()
        self.status_code = 200
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.finished = False
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def pump() -> None:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                clock = self.clock
                async with aclosing(self._events) as events:
                    async for event in events:
                        clock.writing_ns = time.time_ns()
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                self.finished = True
                group.cancel_scope.cancel()

            async def listen() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnected = True
                group.cancel_scope.cancel()

            group.start_soon(pump)
            group.start_soon(listen)
        if self.disconnected and not self.finished:
            with anyio.CancelScope(shield=True):
                await self._on_disconnect()
