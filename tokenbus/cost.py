"""The cost weight of one request: the one rule that quota and billing both apply.

A request's tokens are multiplied by three factors:

- **context length**, from the prompt's token count ``n``:
  ``1.0`` below 2k (``n < 2048``), ``1.2`` from 2k (``2048 <= n < 4096``), and ``0.1``
  more for each further 2k: ``1.3`` from 4k, ``1.4`` from 6k, ``1.5`` from 8k, ...
  In general ``1.2 + 0.1 * (n // 2048 - 1)`` for ``n >= 2048``. Attention over a long
  context costs more per token, in KV-cache memory and in compute;
- **precision** of the served weights: ``0.7`` for ``int8``, ``1.0`` for every other;
- **peak hour**: ``1.5`` when the request was made within the configured peak hours.

The weight is their product. It is pure: the caller passes the instant (billing uses the
request's ``created_at``, the quota its admission time), so both agree for one request.
Factors are exact decimal steps, so ``round(weight, 6)`` is exact for every input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

CONTEXT_STEP_TOKENS = 2048
"""What "2k" means: context-length steps are this many prompt tokens."""
LONG_CONTEXT_FACTOR = 1.2
"""The factor for the first step above 2k."""
PER_STEP_FACTOR = 0.1
"""Added for each further step of ``CONTEXT_STEP_TOKENS``."""
INT8_FACTOR = 0.7
PEAK_FACTOR = 1.5


@dataclass(frozen=True)
class PeakHours:
    """Hours of the day (0-23, in ``tz``) in which work costs ``PEAK_FACTOR`` times more."""

    hours: frozenset[int] = frozenset()
    tz: str = "UTC"
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Looked up once: billing asks for every event it prices.
        object.__setattr__(self, "_zone", ZoneInfo(self.tz))

    @classmethod
    def parse(cls, spec: str, tz: str = "UTC") -> PeakHours:
        """``"9-17"`` is 09:00 up to 17:00; ``"8-12,14-18"`` two spans; ``"22-6"`` wraps
        past midnight; ``""`` means no peak hours. Each span is ``start-end``, end exclusive.
        """
        hours: set[int] = set()
        for span in filter(None, (part.strip() for part in spec.split(","))):
            start_text, sep, end_text = span.partition("-")
            try:
                start, end = int(start_text), int(end_text)
            except ValueError:
                raise ValueError(f"peak hours span {span!r} is not START-END") from None
            if not sep or not (0 <= start <= 23 and 0 <= end <= 24) or start == end:
                raise ValueError(f"peak hours span {span!r}: want START-END, 0 <= hours <= 24")
            num_hours = (end - start) % 24 or 24  # "0-24" is the whole day
            hours.update((start + i) % 24 for i in range(num_hours))
        return cls(frozenset(hours), tz)  # an unknown zone fails here, at start

    def contains(self, at: datetime) -> bool:
        """Whether ``at`` falls in a peak hour; a naive ``at`` is taken as UTC."""
        if not self.hours:
            return False
        aware = at.replace(tzinfo=UTC) if at.tzinfo is None else at
        return aware.astimezone(self._zone).hour in self.hours


NO_PEAK_HOURS = PeakHours()


def context_factor(num_prompt_tokens: int) -> float:
    """1.0 below 2k prompt tokens, 1.2 from 2k, then 0.1 more per further 2k."""
    num_steps = max(0, num_prompt_tokens) // CONTEXT_STEP_TOKENS
    if num_steps == 0:
        return 1.0
    # Tenths as integers, so that 1.2 + 0.1 * k carries no binary rounding drift.
    return (round(LONG_CONTEXT_FACTOR * 10) + round(PER_STEP_FACTOR * 10) * (num_steps - 1)) / 10


def precision_factor(precision: str) -> float:
    return INT8_FACTOR if precision.strip().lower() == "int8" else 1.0


def cost_weight(
    num_prompt_tokens: int, precision: str, at: datetime, peak_hours: PeakHours = NO_PEAK_HOURS
) -> float:
    """The product of the three factors, rounded to 6 decimals (exact for these steps)."""
    peak = PEAK_FACTOR if peak_hours.contains(at) else 1.0
    return round(context_factor(num_prompt_tokens) * precision_factor(precision) * peak, 6)
