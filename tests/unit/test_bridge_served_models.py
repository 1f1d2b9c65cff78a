from __future__ import annotations

from bridge.served_models import ServedModels
from schemas import WorkerStatus


def status(worker: str, model: str) -> WorkerStatus:
    return WorkerStatus(worker_id=worker, model=model, request_topic=f"t.{worker}")


def test_default_model_is_always_served_and_live_workers_add_theirs() -> None:
    served = ServedModels("tiny-llama", dead_after_s=3.0)
    assert served.names(now=0.0) == ["tiny-llama"]
    served.observe(status("w1", "big-llama"), now=10.0)
    assert served.names(now=12.0) == ["big-llama", "tiny-llama"]
    assert served.names(now=13.0) == ["tiny-llama"]  # w1 went quiet
