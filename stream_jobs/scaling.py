"""The scaling signal: how many workers a model needs for what it holds and what waits.

# per model: requests running in the engines + requests waiting (the job's queue and the
# engines' own) --> recommended_workers --> tokenbus_recommended_workers{model}

    recommended = clamp(ceil((running + waiting) / (max_num_seqs * target_utilisation)),
                        min_workers, max_workers)

``max_num_seqs`` is the seats one worker of the model has (its heartbeats say; the
setting while none is live). ``target_utilisation`` below 1 keeps headroom: a fleet
sized for exactly its load has no seat for class 0 (``vip_reserve``) nor for a burst.
Pure: an autoscaler (KEDA's Prometheus scaler, or an HPA on external metrics) reads
the gauge; see deploy/keda.yaml.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalingPolicy:
    target_utilisation: float = 0.8
    min_workers: int = 1
    max_workers: int = 16

    def recommended_workers(self, num_running: int, num_waiting: int, max_num_seqs: int) -> int:
        seats = max(1, max_num_seqs) * max(self.target_utilisation, 1e-6)
        needed = math.ceil((max(0, num_running) + max(0, num_waiting)) / seats)
        return min(self.max_workers, max(self.min_workers, needed))


def create_scaling_policy(
    target_utilisation: float, min_workers: int, max_workers: int
) -> ScalingPolicy:
    return ScalingPolicy(target_utilisation, min_workers, max(min_workers, max_workers))
