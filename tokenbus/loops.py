"""The services' event loop: uvloop, unless ``Settings.event_loop`` says ``asyncio``.

# TOKENBUS_* variables --> Settings --> logs --> serve(settings, stop) on the loop
#   (``run_service``: a service's ``main``; SIGINT or SIGTERM sets ``stop``)

Every tokenbus service is an asyncio program whose CPU goes to callbacks and socket
writes (Kafka fetches and produces, SSE events). uvloop runs the same code with less of
both; on a machine where the services share the cores with the engine, what they save
is the engine's. The comparison is in BENCHMARKS.md (``--set event_loop=asyncio``).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from tokenbus.config import Settings
from tokenbus.logs import setup_logging

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], settings: Settings) -> T:
    """``asyncio.run`` on the configured loop."""
    if settings.event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def install_policy(settings: Settings) -> None:
    """For frameworks that make their own loop (Faust): call before they do."""
    if settings.event_loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


Serve = Callable[[Settings, asyncio.Event], Awaitable[None]]
"""A service's body: runs until the event is set, then stops cleanly."""


def run_service(serve: Serve) -> None:
    """``python -m <service>``: its settings and logs, then ``serve(settings, stop)`` on the
    configured loop, until SIGINT or SIGTERM sets ``stop``."""
    settings = Settings()
    setup_logging(settings)
    run(_until_signalled(serve, settings), settings)


async def _until_signalled(serve: Serve, settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await serve(settings, stop)


async def until_stopped(stop: asyncio.Event, tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Waits until ``stop`` is set or one of ``tasks`` ends, then cancels and awaits the
    rest. A task that failed raises here: it ends the service, so whoever started the
    service sees it exit."""
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in done - {stopping}:
            task.result()
    finally:
        stopping.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
