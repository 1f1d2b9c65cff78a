"""Which models the fleet serves now, from worker heartbeats. Pure: the caller passes the clock.

The configured ``served_model_name`` always counts as served, so ``/v1/models`` answers
the same before the first heartbeat has arrived as after.
"""

from __future__ import annotations

from schemas import WorkerStatus


class ServedModels:
    def __init__(self, default: str, *, dead_after_s: float) -> None:
        self._default = default
        self._dead_after_s = dead_after_s
        self._seen: dict[str, tuple[str, float]] = {}  # worker_id -> (model, seen at)

    def observe(self, status: WorkerStatus, now: float) -> None:
        self._seen[status.worker_id] = (status.model, now)

    def names(self, now: float) -> list[str]:
        live = {model for model, seen in self._seen.values() if now - seen < self._dead_after_s}
        return sorted(live | {self._default})
