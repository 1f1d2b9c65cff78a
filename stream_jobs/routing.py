"""Which worker serves a request: the health score of the source design, plus affinity.

Pure: the dispatcher passes what the heartbeats said and what it sent since.

    score = w_kv·max(0, kv_usage - kv_threshold) + w_queue·queue/capacity
            + w_load·running/capacity - priority_bonus[class]

Lower is better. ``queue`` counts the requests the worker reported waiting plus those
dispatched to it since its last heartbeat, so a burst between heartbeats spreads out.
A worker above the KV threshold gets no new work while another worker is below it:
vLLM would have to preempt to make room. The priority bonus follows the source design;
it lowers every worker's score for a request alike, so it shows in the score a request
is routed at but never changes which worker wins.

Session affinity: a session goes back to the worker that served its previous turn, so
vLLM's prefix cache can serve the shared history, unless that worker's score is worse
than the best by more than ``affinity_margin``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingWeights:
    kv: float = 5.0
    queue: float = 0.3
    load: float = 0.2
    kv_threshold: float = 0.9
    priority_bonus: tuple[float, float, float] = (0.1, 0.05, 0.0)
    affinity_margin: float = 0.25
    adapter_margin: float = 0.25
    """A worker holding a request's LoRA adapter wins within this of the best score
    (``adapter_routing``)."""


@dataclass(frozen=True)
class Candidate:
    """A live worker serving the requested model, as the dispatcher sees it now."""

    worker_id: str
    capacity: int
    num_running: int = 0
    num_waiting: int = 0
    num_unseen: int = 0
    """Dispatched to it since its last heartbeat."""
    kv_usage: float = 0.0
    max_loras: int = 0
    """LoRA adapters one engine step may use; 0: it serves no adapter requests."""
    adapters: frozenset[str] = frozenset()
    """Adapters it holds, or was sent since its last heartbeat (``adapter_routing``)."""


def score(candidate: Candidate, priority: int, weights: RoutingWeights) -> float:
    capacity = max(1, candidate.capacity)
    queue = (candidate.num_waiting + candidate.num_unseen) / capacity
    load = candidate.num_running / capacity
    return (
        weights.kv * max(0.0, candidate.kv_usage - weights.kv_threshold)
        + weights.queue * queue
        + weights.load * load
        - weights.priority_bonus[priority]
    )


def choose(
    candidates: Sequence[Candidate],
    priority: int,
    weights: RoutingWeights,
    *,
    previous: str | None = None,
) -> Candidate | None:
    """The worker for one request; ``previous`` served its session before. None: no worker."""
    if not candidates:
        return None
    below = [c for c in candidates if c.kv_usage <= weights.kv_threshold]
    eligible = below or list(candidates)
    scored = sorted((score(c, priority, weights), c.worker_id, c) for c in eligible)
    best_score, _, best = scored[0]
    if previous is not None:
        for value, worker_id, candidate in scored:
            if worker_id == previous and value <= best_score + weights.affinity_margin:
                return candidate
    return best
