"""bridge.sse: the event stream's write clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from bridge.sse import EventStreamResponse, WriteClock

SLOW_WRITE_S = 0.02


async def test_the_clock_reads_when_each_event_began_to_be_written() -> None:
    clock = WriteClock()
    read_after_resume: list[tuple[int, int]] = []
    began: list[int] = []

    async def events() -> AsyncGenerator[bytes, None]:
        for n in range(2):
            yield f"data: {n}\n\n".encode()
            read_after_resume.append((clock.writing_ns, time.time_ns()))

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            began.append(time.time_ns())
            await asyncio.sleep(SLOW_WRITE_S)  # a write the caller's socket holds up

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def never() -> None:
        raise AssertionError("no disconnect here")

    response = EventStreamResponse(events(), headers={}, on_disconnect=never, clock=clock)
    await response({"type": "http"}, receive, send)  # type: ignore[arg-type]
    assert len(began) == len(read_after_resume) == 2
    for started, (writing_ns, resumed_ns) in zip(began, read_after_resume, strict=True):
        assert writing_ns <= started  # stamped before the write, not when it returned
        assert resumed_ns - writing_ns >= SLOW_WRITE_S * 1e9
    assert response.finished
