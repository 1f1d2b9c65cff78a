"""The services' event loop: uvloop, unless ``Settings.event_loop`` says ``asyncio``.

Every tokenbus service is an asyncio program whose CPU goes to callbacks and socket
writes (Kafka fetches and produces, SSE events). uvloop runs the same code with less of
both; on a machine where the services share the cores with the engine, what they save
is the engine's. The comparison is in BENCHMARKS.md (``--set event_loop=asyncio``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from tokenbus.config import Settings

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
