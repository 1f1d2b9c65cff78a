"""Live workers, from their heartbeats, and the choice of one for a request.

Pure: the caller passes the clock. A worker is live while its last heartbeat is
younger than ``dead_after_s``. Requests sent since a worker's last heartbeat count
against it, so a burst between heartbeats does not all land on one worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import WorkerStatus


@dataclass
class WorkerView:
    status: WorkerStatus
    seen_at: float
    num_unseen_dispatches: int = 0

    @property
    def load(self) -> float:
        queued = self.status.num_running + self.status.num_waiting + self.num_unseen_dispatches
        return queued / max(1, self.status.max_num_seqs)


@dataclass
class WorkerRegistry:
    dead_after_s: float = 3.0
    _workers: dict[str, WorkerView] = field(default_factory=dict)

    def observe(self, status: WorkerStatus, now: float) -> None:
        self._workers[status.worker_id] = WorkerView(status=status, seen_at=now)

    def all_live(self, now: float) -> list[WorkerView]:
        return [
            view
            for view in self._workers.values()
            if not view.status.draining and now - view.seen_at < self.dead_after_s
        ]

    def live(self, model: str, now: float) -> list[WorkerView]:
        return [
            view
            for view in self._workers.values()
            if view.status.model == model
            and not view.status.draining
            and now - view.seen_at < self.dead_after_s
        ]

    def pick_worker(self, model: str, now: float) -> WorkerView | None:
        """The least-loaded live worker serving ``model``; None when there is none."""
        candidates = self.live(model, now)
        if not candidates:
            return None
        best = min(candidates, key=lambda view: (view.load, view.status.worker_id))
        best.num_unseen_dispatches += 1
        return best

    def models(self, now: float) -> set[str]:
        return {
            view.status.model
            for view in self._workers.values()
            if now - view.seen_at < self.dead_after_s
        }
