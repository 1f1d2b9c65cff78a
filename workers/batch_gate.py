"""Batch gate: a worker's class 2 lines give its engine back the moment interactive work comes.

# WorkItem taken: class 0/1 --> BatchGate.interactive_started ... interactive_ended
# class 2 line --> await BatchGate.enter(key) --> Engine.generate --> BatchGate.leave(key)
# cap below the lines running --> the newest are paused (Engine.abort); each waits, then
#   continues from its prompt and the tokens it made (workers.worker: _generate)

The job's batch yield (``tokenbus.batch_yield``) stops forwarding class 2 above
``batch_yield_seats_per_worker`` lines per worker while a model has interactive traffic.
The lines an engine already runs would go on beside the first interactive requests: on
the development machine the interactive request that found 44 batch lines running took
3 to 6 times its time to first token alone, and at c=1 that one request is the wave's
p99 (BENCHMARKS.md, section 7). This gate holds the same cap inside the worker, over
the lines already running: those above it are aborted in the engine and wait here; when
the cap lifts, or a line under it ends, they continue from their own prompt plus the
tokens they had made, as a failover resume does. No token is made or delivered twice,
the stream's seq numbers carry on, and the usage event counts the line once; the
continued prompt is mostly back from the prefix cache.

While the cap holds, class 2 lines wait in arrival order, paused ones first (they began
first). It holds by the job's rule, per worker: while a class 0/1 request runs here, or
for ``hold_s`` after the last one came or ended.

How many lines may run beside interactive work is learned (``SeatLearner``), from 0 up to
the job's ``seats_per_worker``: a host whose engine shares its cores with the bus's
services (vLLM on the CPU of a 2-core machine: one running batch line keeps the engine's
core busy, and the interactive path loses half the machine) learns to run none, while a
GPU host, where a few more sequences in a step cost little, learns to run the most.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

from tokenbus.batch_yield import BatchYield, YieldPolicy

log = logging.getLogger(__name__)

ABORTS_WAIT_S = 0.5
"""How long an interactive request waits for the aborts of the lines it paused to go out."""


def plan_seats(num_running: int, num_waiting: int, cap: int | None) -> tuple[int, int]:
    """(waiting lines to start, running lines to pause) for ``cap`` (None: no cap)."""
    if cap is None:
        return num_waiting, 0
    if num_running > cap:
        return 0, num_running - cap
    return min(num_waiting, cap - num_running), 0


Step = Literal["probe", "probe_held", "probe_failed", "halved"]
"""What one observation made the learner do: let one more line run, find the last probe
held or failed (failed: the seats halved), or halve the seats outside a probe."""


@dataclass
class SeatLearner:
    """How many class 2 lines may run beside interactive work on one engine: AIMD on the
    time to first token of the interactive requests, at the worker (taken to first token).

    A request that starts with no batch line running is a baseline sample (the lowest of
    the last ``window`` is the baseline). One that met batch lines and took more than
    ``ratio`` x the baseline halves the seats (down to none); ``probe_after`` requests in
    a row within the target, while the seats bind (more lines want to run than may),
    let one more line run, to find out whether it fits; with no batch line wanting a
    seat there is nothing to learn.

    A probe costs the request it fails on. So a probe that failed (a halving from seats
    the learner had let run) doubles the requests before the next one, up to
    ``probe_after_max``, and a probe that held (``probe_after`` requests within the target
    beside the line it added) brings the wait back to ``probe_after``: a host where one
    line never fits (vLLM on the CPU beside the bus, BENCHMARKS.md section 7) soon probes
    a few times an hour of interactive traffic instead of every ``probe_after`` requests,
    and a GPU host, where probes hold, keeps learning at the full pace. Pure.
    """

    max_seats: int
    ratio: float = 1.5
    probe_after: int = 32
    probe_after_max: int = 1024
    window: int = 60
    seats: int = 0
    """Starts at none: the first interactive request of a host never meets a batch line
    that has not been shown to fit."""
    num_within: int = 0
    probe_wait: int = field(init=False)
    """Requests within the target before the next probe (``probe_after`` until one fails)."""
    num_since_probe: int | None = field(default=None, init=False)
    """Requests within the target since the last probe, while it is not yet shown to hold."""
    _samples: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.probe_wait = self.probe_after

    def baseline(self) -> float | None:
        return min(self._samples) if self._samples else None

    def observe(
        self, ttft_s: float, num_batch_running: int, num_batch_waiting: int = 0
    ) -> tuple[Step, ...]:
        """Learns from one interactive request's time to first token; returns what that
        changed, in order (a probe that held may be followed by the next probe)."""
        if num_batch_running == 0:
            self._samples.append(ttft_s)
            while len(self._samples) > self.window:
                self._samples.popleft()
        baseline = self.baseline()
        if baseline is None:
            return ()
        within = ttft_s <= self.ratio * baseline
        if not within and num_batch_running > 0:
            step: Step = "halved"
            if self.num_since_probe is not None:  # the last probe failed: wait longer
                self.probe_wait = min(2 * self.probe_wait, self.probe_after_max)
                self.num_since_probe = None
                step = "probe_failed"
            self.seats //= 2
            self.num_within = 0
            return (step,)
        steps: tuple[Step, ...] = ()
        if within and self.num_since_probe is not None and num_batch_running > 0:
            self.num_since_probe += 1
            if self.num_since_probe >= self.probe_after:  # the probe held
                self.probe_wait = self.probe_after
                self.num_since_probe = None
                steps = ("probe_held",)
        if within and num_batch_running + num_batch_waiting > self.seats:
            self.num_within += 1
            if self.num_within >= self.probe_wait and self.seats < self.max_seats:
                self.seats += 1
                self.num_within = 0
                self.num_since_probe = 0
                steps = (*steps, "probe")
        return steps


class BatchGate:
    """The class 2 lines of one worker's engine: which run, which wait (see the module)."""

    def __init__(
        self,
        policy: YieldPolicy,
        model: str,
        abort: Callable[[str], Awaitable[None]],
        *,
        learner: SeatLearner | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._yield = BatchYield(policy)
        self.learner = learner or SeatLearner(max_seats=policy.seats_per_worker)
        self._hold_s = policy.hold_s
        self._model = model
        self._abort = abort
        self._clock = clock
        self._running: dict[Hashable, str | None] = {}
        """Lines in the engine, in the order they started, with their engine ids."""
        self._paused: set[Hashable] = set()
        """Running lines this gate aborted: their stream's end is a pause, not a finish."""
        self._waiting: deque[tuple[Hashable, asyncio.Future[None]]] = deque()
        self._num_interactive = 0
        self._reopen: asyncio.TimerHandle | None = None
        self._aborts: set[asyncio.Task[None]] = set()
        self.num_pauses = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def cap(self) -> int | None:
        """Lines that may run now: None (no cap) unless interactive work is here."""
        yielding = self._yield.is_yielding(
            self._model, self._clock(), num_interactive_in_flight=self._num_interactive
        )
        return self.learner.seats if yielding else None

    async def enter(self, key: Hashable, *, paused_before: bool = False) -> None:
        """Returns once ``key`` may run in the engine; a line paused before goes first."""
        if not self._waiting and plan_seats(self._num_active(), 1, self.cap())[0]:
            self._running[key] = None
            return
        waiter = asyncio.get_running_loop().create_future()
        if paused_before:
            self._waiting.appendleft((key, waiter))
        else:
            self._waiting.append((key, waiter))
        self._rebalance()  # may start it at once, or sets the look once the hold is over
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.leave(key)  # admitted as it was cancelled: give the seat back
            else:
                self._drop_waiter(waiter)
            raise

    def bind(self, key: Hashable, engine_id: str) -> bool:
        """``key`` starts in the engine as ``engine_id``; False if it was paused since it
        entered (then it must not start: ``leave``, then ``enter`` again)."""
        if key in self._paused or key not in self._running:
            return False
        self._running[key] = engine_id
        return True

    def is_paused(self, key: Hashable) -> bool:
        return key in self._paused

    def leave(self, key: Hashable) -> bool:
        """``key`` left the engine; True if this gate had paused it."""
        self._running.pop(key, None)
        paused = key in self._paused
        self._paused.discard(key)
        self._rebalance()
        return paused

    def interactive_started(self) -> None:
        self._num_interactive += 1
        self._yield.note_interactive(self._model, self._clock())
        self._rebalance()

    async def aborts_sent(self) -> None:
        """Returns once the engine has been told of every line paused so far. An
        interactive request that paused lines waits for this before it is added, so the
        engine takes the aborts no later than the request: its first step is its own,
        not one more of the batch's full width. Bounded: an engine slow to take them
        must not hold the request."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=ABORTS_WAIT_S)

    def interactive_first_token(self, ttft_s: float) -> tuple[Step, ...]:
        """An interactive request here made its first token ``ttft_s`` after it was taken;
        returns what the learner did with it."""
        num_running = self._num_active()
        steps = self.learner.observe(ttft_s, num_running, len(self._waiting) + len(self._paused))
        for step in steps:
            log.info(
                "batch seats: %s at TTFT %.0f ms (baseline %.0f ms) beside %d lines; now %d"
                " seats, next probe after %d requests",
                step.replace("_", " "),
                1000 * ttft_s,
                1000 * (self.learner.baseline() or 0.0),
                num_running,
                self.learner.seats,
                self.learner.probe_wait,
            )
        self._rebalance()
        return steps

    def interactive_ended(self) -> None:
        self._num_interactive = max(0, self._num_interactive - 1)
        self._yield.note_interactive(self._model, self._clock())  # the hold counts from here
        self._rebalance()

    def _num_active(self) -> int:
        return len(self._running) - len(self._paused)

    def _rebalance(self) -> None:
        cap = self.cap()
        active = [key for key in self._running if key not in self._paused]
        num_start, num_pause = plan_seats(len(active), len(self._waiting), cap)
        while num_start and self._waiting:
            key, waiter = self._waiting.popleft()
            if waiter.done():
                continue  # its task was cancelled
            self._running[key] = None
            waiter.set_result(None)
            num_start -= 1
        for key in active[len(active) - num_pause :] if num_pause else ():
            self._paused.add(key)
            self.num_pauses += 1
            engine_id = self._running[key]
            if engine_id is not None:
                self._start_abort(engine_id)
        if cap is not None and self._num_interactive == 0 and (self._waiting or self._paused):
            self._reopen_after(self._hold_s)

    def _reopen_after(self, delay_s: float) -> None:
        """Looks again once the hold may be over (the cap lifts by time, not by an event)."""
        if self._reopen is not None:
            self._reopen.cancel()
        loop = asyncio.get_running_loop()
        self._reopen = loop.call_later(delay_s + 0.01, self._on_reopen)

    def _on_reopen(self) -> None:
        self._reopen = None
        self._rebalance()

    def _drop_waiter(self, waiter: asyncio.Future[None]) -> None:
        self._waiting = deque(item for item in self._waiting if item[1] is not waiter)

    def _start_abort(self, engine_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_logged(engine_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_logged(self, engine_id: str) -> None:
        try:
            await self._abort(engine_id)
        except Exception:
            log.exception("pausing %s failed; it runs on", engine_id)
