"""How long the sink waits before retrying a failed write: capped exponential backoff."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0

    def delay_s(self, num_failures: int) -> float:
        """The wait after the ``num_failures``-th consecutive failure (1, 2, ...)."""
        return min(self.max_s, self.initial_s * self.factor ** max(0, num_failures - 1))
