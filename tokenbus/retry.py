"""How a sink or the webhook retries a write: capped exponential backoff, until done or stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0

    def delay_s(self, num_failures: int) -> float:
        """The wait after the ``num_failures``-th consecutive failure (1, 2, ...)."""
        return min(self.max_s, self.initial_s * self.factor ** max(0, num_failures - 1))


async def until_done(
    attempt: Callable[[], Awaitable[None]],
    stop: asyncio.Event,
    backoff: Backoff,
    what: str,
    on_failure: Callable[[], None] | None = None,
) -> bool:
    """Retries ``attempt`` with ``backoff``; False if ``stop`` was set while waiting (the
    caller then commits nothing, so what it was writing is redelivered)."""
    num_failures = 0
    while True:
        try:
            await attempt()
            return True
        except Exception as exc:
            num_failures += 1
            if on_failure is not None:
                on_failure()
            delay_s = backoff.delay_s(num_failures)
            log.warning(
                "%s failed (%d in a row), retrying in %.1f s: %s", what, num_failures, delay_s, exc
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=delay_s)
        if stop.is_set():
            log.warning("stopping with %s undone; it will be redelivered", what)
            return False
