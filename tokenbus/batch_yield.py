"""Batch yield: class 2 gives a model's engines back at once when interactive traffic comes.

# class 0/1 queued --> BatchYield.note_interactive(model, now)
# the dispatch loop, class 2 head --> batch_cap() --> forwarded only below the cap
# the dispatch loop, class 0/1 head --> num_yielding() --> seats has_room need not wait for

The batch runner's pacer (``batches.pacing``) adapts a batch's lines in flight to the
job's load reports: a report interval and a step later, about a second, by which time
the first interactive requests of a burst have met engines full of batch lines. This
policy acts on the first one. While class 0/1 requests for a model are in flight, or
one was queued in the last ``hold_s`` seconds, class 2 may hold at most
``seats_per_worker`` seats per live worker of that model. The lines above that cap
are not stopped (vLLM preempts only for KV space, not for priority, and an abort would
run a line twice): they finish, no new one is forwarded, and the engines' share of batch
lines falls within one line's length. Until then class 0/1 do not wait for them: the
seats they hold above the cap count as free for interactive requests, as long as the
fleet has a seat at all (``seats.has_room``'s ``num_yielding``). Once interactive
traffic has been gone ``hold_s``, the cap lifts and the lines the runner keeps waiting
in the job go out at the next turn.

Pure: time comes in as ``now`` (the job's monotonic clock).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class YieldPolicy:
    seats_per_worker: int = 4
    """Class 2 seats per live worker of a model while its interactive traffic runs."""
    hold_s: float = 3.0
    """How long after the last class 0/1 request was queued the cap holds."""

    def __post_init__(self) -> None:
        if self.seats_per_worker < 0 or self.hold_s < 0:
            raise ValueError(f"need seats_per_worker >= 0 and hold_s >= 0, got {self}")


class BatchYield:
    """When each model last saw interactive traffic, and what that leaves class 2."""

    def __init__(self, policy: YieldPolicy) -> None:
        self._policy = policy
        self._last_interactive: dict[str, float] = {}

    def note_interactive(self, model: str, now: float) -> None:
        """A class 0/1 request for ``model`` was queued."""
        self._last_interactive[model] = now

    def is_yielding(self, model: str, now: float, *, num_interactive_in_flight: int) -> bool:
        if num_interactive_in_flight > 0:
            return True
        last = self._last_interactive.get(model)
        return last is not None and now - last < self._policy.hold_s

    def batch_cap(
        self, model: str, now: float, *, num_workers: int, num_interactive_in_flight: int
    ) -> int | None:
        """The most class 2 requests ``model`` may have in flight now; None: no cap
        beyond the seats' (``seats.has_room``)."""
        if not self.is_yielding(model, now, num_interactive_in_flight=num_interactive_in_flight):
            return None
        return self._policy.seats_per_worker * num_workers


def num_yielding(num_batch_in_flight: int, cap: int | None) -> int:
    """Class 2 requests in flight above the cap: finishing, and not to be waited for."""
    return 0 if cap is None else max(0, num_batch_in_flight - cap)


def create_batch_yield(seats_per_worker: int, hold_s: float) -> BatchYield:
    """The yield the settings describe. A cap at or above a worker's seats never binds:
    that turns the yield off."""
    return BatchYield(YieldPolicy(seats_per_worker=seats_per_worker, hold_s=hold_s))
