"""How many batch lines a runner keeps in flight: AIMD on the job's interactive signals.

# LoadReport (the job's, every load_report_interval_s, per model) --> AimdPacer.observe
# --> pressure? (interactive requests waiting for a seat, or their queue wait or TTFT
#     p99 above target) --> halve the limit : add a step --> AimdPacer.limit()

Pure: no I/O, and time only through the injected clock. The runner calls ``observe``
for each report it reads and ``limit`` before it sends a line.

Continuous batching makes every decode step slower as the batch grows, so priority
alone does not keep interactive latency: the pacer also holds the number of batch lines
down while interactive traffic suffers. The rule, at most once per ``step_s``:

- pressure: class 0/1 requests wait at the job for a seat, or the interval's interactive
  queue-wait p99 or TTFT p99 is above its target, ``max(floor, ratio x baseline)``
  (``Settings.batch_target_interactive_ratio``, ``batch_target_floor_ms``,
  ``batch_target_ttft_floor_ms``) --> the limit is multiplied by ``decrease`` (halved),
  down to ``min_in_flight``: from 64 to 8 in three reports;
- otherwise --> the limit grows by ``increase`` up to ``max_in_flight``: with the
  defaults (a sixteenth of the maximum per second) from 1 back to full in 16 s.

A baseline is what the signal measures while batch lines were few (at most
``baseline_in_flight`` in flight, the job's count): the lowest of its last 60 such
samples, so a spell of heavy interactive load does not raise it; until there is one, the
floor alone is the target. The limit moves only on reports: while none
come (the job or the topic down) it holds, neither growing blind nor collapsing.

A pacer paces one model's lines (``model``; None: every report counts, and the most
pressed model decides).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from schemas import LoadReport
    from tokenbus.config import Settings


class Pacer(Protocol):
    def limit(self) -> int:
        """Lines allowed in flight now."""
        ...

    def observe(self, report: LoadReport) -> None:
        """A job load report arrived."""
        ...


@dataclass(frozen=True)
class Targets:
    ratio: float = 1.5
    """Pressure: an interactive p99 above this times its baseline."""
    queue_floor_ms: float = 50.0
    """A queue-wait p99 at or below this is never pressure."""
    ttft_floor_ms: float = 100.0
    """A TTFT p99 at or below this is never pressure."""


class _Baseline:
    """The lowest of a signal's last ``window`` samples taken with few batch lines running:
    what interactive traffic gets when the fleet is its own. The lowest, not an average,
    so that a spell of heavy interactive load (a c=64 burst with no batch running) does
    not raise the target for the light traffic after it (measured: an average over such a
    spell put the TTFT target at 860 ms against 62 ms alone)."""

    def __init__(self, window: int = 60) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.value: float | None = None

    def note(self, sample: float) -> None:
        self._samples.append(sample)
        self.value = min(self._samples)

    def target(self, ratio: float, floor: float) -> float:
        return floor if self.value is None else max(floor, ratio * self.value)


class AimdPacer:
    """Additive increase, multiplicative decrease of the lines in flight (see the module)."""

    def __init__(
        self,
        *,
        max_in_flight: int,
        targets: Targets | None = None,
        model: str | None = None,
        min_in_flight: int = 1,
        initial: int | None = None,
        increase: int | None = None,
        decrease: float = 0.5,
        step_s: float = 1.0,
        baseline_in_flight: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= min_in_flight <= max_in_flight:
            raise ValueError(f"need 1 <= min_in_flight ({min_in_flight}) <= max ({max_in_flight})")
        if not 0 < decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {decrease}")
        self._max = max_in_flight
        self._min = min_in_flight
        self._targets = targets or Targets()
        self._model = model
        self._increase = increase if increase is not None else max(1, math.ceil(max_in_flight / 16))
        self._decrease = decrease
        self._step_s = step_s
        self._baseline_in_flight = baseline_in_flight
        self._clock = clock
        self._limit = float(initial if initial is not None else max_in_flight)
        self._limit = min(max(self._limit, self._min), self._max)
        self._queue_baseline = _Baseline()
        self._ttft_baseline = _Baseline()
        self._last_step: float | None = None
        self._pending = False
        """Pressure seen since the last step: one pressed report in a step's span counts."""
        self.num_decreases = 0
        self.num_increases = 0

    def limit(self) -> int:
        return int(self._limit)

    def observe(self, report: LoadReport) -> None:
        if self._model is not None and report.model != self._model:
            return
        now = self._clock()
        quiet = report.num_batch_in_flight <= self._baseline_in_flight
        if quiet and report.interactive_queue_ms_p99 is not None:
            self._queue_baseline.note(report.interactive_queue_ms_p99)
        if quiet and report.interactive_ttft_ms_p99 is not None:
            self._ttft_baseline.note(report.interactive_ttft_ms_p99)
        pressed = self._pending or self.is_pressure(report)
        if self._last_step is not None and now - self._last_step < self._step_s:
            self._pending = pressed  # within a step: kept for the next one
            return
        self._pending = False
        self._step(pressed, now)

    def is_pressure(self, report: LoadReport) -> bool:
        """Whether the report shows interactive traffic suffering (see the module)."""
        targets = self._targets
        waiting = report.num_waiting_by_class[0] + report.num_waiting_by_class[1]
        if waiting > 0:
            return True
        queue = report.interactive_queue_ms_p99
        if queue is not None and queue > self._queue_baseline.target(
            targets.ratio, targets.queue_floor_ms
        ):
            return True
        ttft = report.interactive_ttft_ms_p99
        return ttft is not None and ttft > self._ttft_baseline.target(
            targets.ratio, targets.ttft_floor_ms
        )

    def _step(self, pressed: bool, now: float) -> None:
        self._last_step = now
        if pressed:
            self._limit = max(float(self._min), math.floor(self._limit * self._decrease))
            self.num_decreases += 1
        elif self._limit < self._max:
            self._limit = min(float(self._max), self._limit + self._increase)
            self.num_increases += 1


def create_pacer(
    settings: Settings, model: str | None = None, clock: Callable[[], float] = time.monotonic
) -> AimdPacer:
    """The pacer the settings describe, for one model's lines (None: any model)."""
    return AimdPacer(
        max_in_flight=settings.batch_max_in_flight,
        targets=Targets(
            ratio=settings.batch_target_interactive_ratio,
            queue_floor_ms=settings.batch_target_floor_ms,
            ttft_floor_ms=settings.batch_target_ttft_floor_ms,
        ),
        model=model,
        # A little under the interval, so that one report each interval steps each time.
        step_s=0.9 * settings.load_report_interval_s,
        clock=clock,
    )


class Shares:
    """One pacer for every batch a runner drives: each running batch may keep an equal
    share of the pacer's limit in flight (at least one line), so two batches together
    load the fleet as one would. Pure; the runner feeds the pacer the load reports."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer
        self._num_open = 0

    def share(self) -> Share:
        """A batch's share, counted until it is closed."""
        self._num_open += 1
        return Share(self)

    def _close(self) -> None:
        self._num_open = max(0, self._num_open - 1)

    def limit_per_batch(self) -> int:
        return max(1, self.pacer.limit() // max(1, self._num_open))


class Share:
    """A ``Pacer`` for one batch: its part of the shared limit."""

    def __init__(self, shares: Shares) -> None:
        self._shares = shares
        self._open = True

    def limit(self) -> int:
        return self._shares.limit_per_batch()

    def observe(self, report: LoadReport) -> None:
        """Reports go to the shared pacer, once each, not through every share."""

    def close(self) -> None:
        if self._open:
            self._open = False
            self._shares._close()
