"""A Server-Sent Events response that knows when its client went away.

Starlette's StreamingResponse stops quietly on a disconnect; the bridge must also
cancel the request on the bus, at once, because the worker keeps generating (and
billing) until it hears. So this response runs the event pump and a disconnect
listener side by side, and on a disconnect before the last event it calls
``on_disconnect`` shielded from the cancellation that is tearing the stream down.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        *,
        headers: Mapping[str, str],
        on_disconnect: Callable[[], Awaitable[None]],
    ) -> None:
        self._events = events
        self._on_disconnect = on_disconnect
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
                async with aclosing(self._events) as events:
                    async for event in events:
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
