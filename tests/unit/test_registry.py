from __future__ import annotations

from schemas import WorkerStatus
from stream_jobs.registry import WorkerRegistry


def status(
    worker_id: str, *, model: str = "m", running: int = 0, draining: bool = False, capacity: int = 4
) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        model=model,
        request_topic=f"t.{worker_id}",
        num_running=running,
        max_num_seqs=capacity,
        draining=draining,
    )


def test_picks_the_least_loaded_worker_of_the_model() -> None:
    registry = WorkerRegistry()
    registry.observe(status("w1", running=3), now=0.0)
    registry.observe(status("w2", running=1), now=0.0)
    registry.observe(status("w3", model="other"), now=0.0)
    picked = registry.pick_worker("m", now=1.0)
    assert picked is not None and picked.status.worker_id == "w2"


def test_a_burst_between_heartbeats_spreads_over_workers() -> None:
    registry = WorkerRegistry()
    registry.observe(status("w1"), now=0.0)
    registry.observe(status("w2"), now=0.0)
    picks = [registry.pick_worker("m", now=0.1) for _ in range(6)]
    ids = [p.status.worker_id for p in picks if p is not None]
    assert ids.count("w1") == ids.count("w2") == 3


def test_silent_and_draining_workers_are_not_picked() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("old"), now=0.0)
    registry.observe(status("leaving", draining=True), now=5.0)
    assert registry.pick_worker("m", now=5.0) is None
    assert registry.models(now=5.0) == {"m"}


def test_a_heartbeat_resets_the_unseen_dispatch_count() -> None:
    registry = WorkerRegistry()
    registry.observe(status("w1"), now=0.0)
    for _ in range(3):
        registry.pick_worker("m", now=0.1)
    registry.observe(status("w1", running=3), now=0.5)
    picked = registry.pick_worker("m", now=0.6)
    assert picked is not None and picked.load == 1.0
