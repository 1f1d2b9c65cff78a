"""When a batch dispatches, stops, and ends: cancel, expiry, completion, its ETA. Pure.

# (now, deadline, cancel asked, lines left, lines in flight) --> decide --> Step
# (now, lines done) samples --> Pace --> lines/s --> eta_s

Cancel stops dispatching, lets the running lines finish, and ends the rest as
``batch_cancelled``. Expiry (``completion_window`` from creation) stops dispatching,
aborts the running lines, waits at most ``grace_s`` for their last chunks, and ends
every line without a result as ``batch_expired``. The clock is the caller's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

Ending = Literal["completed", "cancelled", "expired"]


@dataclass(frozen=True)
class Step:
    dispatch: bool
    """Whether new lines may be produced now."""
    abort_running: bool = False
    """Whether the lines in flight are to be aborted (expiry)."""
    status: Literal["in_progress", "cancelling"] = "in_progress"
    end: Ending | None = None
    """Set: finalize now, with this status; lines without a result get its error."""


def decide(
    now: float,
    *,
    expires_at: float,
    cancel_requested: bool,
    num_left: int,
    num_in_flight: int,
    grace_s: float,
) -> Step:
    """``num_left``: lines without a result (in flight or not yet run)."""
    if num_left == 0:
        return Step(dispatch=False, end="cancelled" if cancel_requested else "completed")
    if now >= expires_at:
        over = num_in_flight == 0 or now >= expires_at + grace_s
        return Step(dispatch=False, abort_running=True, end="expired" if over else None)
    if cancel_requested:
        return Step(
            dispatch=False,
            status="cancelling",
            end="cancelled" if num_in_flight == 0 else None,
        )
    return Step(dispatch=True)


ENDING_ERRORS: dict[Ending, tuple[str, str]] = {
    "cancelled": ("batch_cancelled", "the batch was cancelled before this line ran"),
    "expired": ("batch_expired", "the batch's completion_window ended before this line ran"),
    "completed": ("batch_failed", "the line ended without a result"),
}


class Pace:
    """Lines finished per second over the last ``window_s``, for the ETA."""

    def __init__(self, window_s: float = 30.0) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def observe(self, now: float, num_done: int) -> None:
        self._samples.append((now, num_done))
        while len(self._samples) > 2 and self._samples[0][0] < now - self._window_s:
            self._samples.popleft()

    def lines_per_s(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        if t1 <= t0 or n1 <= n0:
            return None
        return (n1 - n0) / (t1 - t0)

    def eta_s(self, num_left: int) -> float | None:
        rate = self.lines_per_s()
        if num_left == 0:
            return 0.0
        return None if rate is None else round(num_left / rate, 1)
