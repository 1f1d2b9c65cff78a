"""The clock a service injects into its policies: one object, two readings.

- ``time()``: wall-clock seconds since the epoch. What a record is stamped with, what is
  compared with another process's stamp (a heartbeat's age, an input's lag), and what
  windows, ledgers and calendar periods are read on.
- ``monotonic()``: seconds from an arbitrary origin, never stepping back (NTP may step
  the wall clock): how long something waited or has been quiet (queue waits, worker
  liveness, report intervals).

Production reads ``SYSTEM_CLOCK``. A unit test injects a clock it moves by hand; the
integration tests move a running job's wall reading through ``OffsetClock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never less than an earlier reading."""
        ...


class SystemClock:
    """The machine's clocks: ``time.time`` and ``time.monotonic``."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = SystemClock()


class OffsetClock:
    """``base``, its wall reading moved on by ``offset()`` seconds (read at every call);
    its monotonic reading is ``base``'s, so a moved clock ages nothing by itself."""

    def __init__(self, offset: Callable[[], float], base: Clock = SYSTEM_CLOCK) -> None:
        self._offset = offset
        self._base = base

    def time(self) -> float:
        return self._base.time() + self._offset()

    def monotonic(self) -> float:
        return self._base.monotonic()
