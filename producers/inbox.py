"""A mailbox for one reader: items put by another task, taken with a timeout.

# producer side --> put(item) --> items (a deque); wakes the one waiter
# reader --> wait(timeout_s) --> True once an item is there; False after timeout_s of none

Every relayed token passes one of these (its request's ``ReplyStream``).
``asyncio.Queue`` with ``asyncio.wait_for`` costs a task and a timer per item on
Python 3.11; here a wait costs one future, and the timer is armed once per quiet spell:
a wait that finds one already armed for no later than its own deadline keeps it, and a
timer that fires before the current wait's deadline re-arms itself for it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")

EARLY_S = 0.001
"""A timer within this of its wait's deadline counts as on time (loops may run a timer
up to their clock resolution early; re-arming for the remainder would spin)."""


class Inbox(Generic[T]):
    __slots__ = ("_deadline", "_loop", "_timer", "_timer_at", "_waiter", "items")

    def __init__(self) -> None:
        self.items: deque[T] = deque()
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[bool] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def put(self, item: T) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(True)

    async def wait(self, timeout_s: float | None) -> bool:
        """True once an item is there; False if none came within ``timeout_s`` (None:
        no limit). One reader at a time."""
        if self.items:
            return True
        loop = self._loop
        if timeout_s is not None:
            self._deadline = deadline = loop.time() + timeout_s
            if self._timer is None or self._timer_at > deadline:
                self._arm(deadline)
        else:
            self._deadline = float("inf")
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        try:
            return await waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        """Drops the timer; call when the reader is done."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._expire)

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms a timer of its own
        if self._loop.time() + EARLY_S < self._deadline:
            if self._deadline != float("inf"):
                self._arm(self._deadline)  # a wait that began after this timer was armed
            return
        self._waiter = None
        waiter.set_result(False)
