"""Which worker serves a request for a LoRA adapter: adapter affinity on top of the score.

Pure, like ``routing``: the dispatcher passes the candidates (live workers of the base
model, with the adapters each holds) and the session's previous worker.

Loading an adapter costs a worker a first-load pause and a slot in its adapter cache
(``max_cpu_loras``), and vLLM batches requests of one adapter together. So requests for
an adapter go where it is already held, as long as that costs little. The rule, in order:

1. Only workers with LoRA enabled (``max_loras > 0``) can serve it.
2. Session first: the worker that served the session's previous turn, while it scores
   within ``affinity_margin`` of the best (as in ``routing.choose``). It served the
   previous turn with the same adapter (a session's adapter is its model name), so it
   holds both the adapter and the session's prefix cache, keyed by adapter too.
3. Else the best-scoring worker that holds the adapter and still has room (running,
   waiting and just-dispatched requests below its ``max_num_seqs``), while it scores
   within ``adapter_margin`` of the best.
4. Else (nobody holds it, or every holder is saturated or scores too badly): among the
   workers within ``adapter_margin`` of the best, the one holding the fewest adapters,
   then the best score. A new adapter goes to the least crowded cache, and a hot one
   spreads to a second worker once its holders are full.

"Holds" is what the worker's heartbeat says, plus what the dispatcher sent it since
(``Candidate.adapters``), so a burst for a new adapter is not spread over every worker
before the first heartbeat reports it loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

from stream_jobs.routing import Candidate, RoutingWeights, choose, score


def has_room(candidate: Candidate) -> bool:
    queued = candidate.num_running + candidate.num_waiting + candidate.num_unseen
    return queued < max(1, candidate.capacity)


def choose_for_adapter(
    candidates: Sequence[Candidate],
    priority: int,
    weights: RoutingWeights,
    *,
    adapter: str | None,
    previous: str | None = None,
) -> Candidate | None:
    """The worker for one request of ``adapter`` (None: the base model, ``routing.choose``)."""
    if adapter is None:
        return choose(candidates, priority, weights, previous=previous)
    capable = [c for c in candidates if c.max_loras > 0]
    if not capable:
        return None
    below = [c for c in capable if c.kv_usage <= weights.kv_threshold]
    eligible = below or capable
    scored = sorted((score(c, priority, weights), c.worker_id, c) for c in eligible)
    best_score = scored[0][0]
    for value, worker_id, candidate in scored:
        if worker_id == previous and value <= best_score + weights.affinity_margin:
            return candidate
    near = [(v, c) for v, _, c in scored if v <= best_score + weights.adapter_margin]
    for _, candidate in near:
        if adapter in candidate.adapters and has_room(candidate):
            return candidate
    return min(near, key=lambda vc: (len(vc[1].adapters), vc[0], vc[1].worker_id))[1]
