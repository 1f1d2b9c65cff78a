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

from tokenbus.config import Settings

_SET = Settings.model_fields
"""The defaults are the settings' (``route_*``, ``*_margin``): one set of numbers."""


@dataclass(frozen=True)
class RoutingWeights:
    kv: float = _SET["route_weight_kv"].default
    queue: float = _SET["route_weight_queue"].default
    load: float = _SET["route_weight_load"].default
    kv_threshold: float = _SET["route_kv_threshold"].default
    priority_bonus: tuple[float, float, float] = _SET["route_priority_bonus"].default
    affinity_margin: float = _SET["affinity_margin"].default
    adapter_margin: float = _SET["adapter_margin"].default
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
    eligible = below or candidates
    # The lowest score, ties to the lowest id; one pass, no sort (a pick reads every
    # live worker of the model).
    best_score, _, best = min((score(c, priority, weights), c.worker_id, c) for c in eligible)
    if previous is not None:
        for candidate in eligible:
            if candidate.worker_id == previous:
                if score(candidate, priority, weights) <= best_score + weights.affinity_margin:
                    return candidate
                break
    return best
