from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_jobs.routing import Candidate, RoutingWeights, choose, score

WEIGHTS = RoutingWeights()


def test_equal_workers_share_a_burst_evenly() -> None:
    workers = {w: Candidate(worker_id=w, capacity=4) for w in ("w1", "w2", "w3")}
    counts: Counter[str] = Counter()
    for _ in range(30):
        picked = choose(list(workers.values()), 1, WEIGHTS)
        assert picked is not None
        counts[picked.worker_id] += 1
        workers[picked.worker_id] = dataclasses.replace(picked, num_unseen=picked.num_unseen + 1)
        # Never more than one request ahead of any other worker.
        assert max(counts[w] for w in workers) - min(counts[w] for w in workers) <= 1
    assert counts == {"w1": 10, "w2": 10, "w3": 10}


def test_a_burst_fills_a_bigger_worker_in_proportion() -> None:
    workers = {
        "big": Candidate(worker_id="big", capacity=8),
        "small": Candidate(worker_id="small", capacity=4),
    }
    counts: Counter[str] = Counter()
    for _ in range(12):
        picked = choose(list(workers.values()), 1, WEIGHTS)
        assert picked is not None
        counts[picked.worker_id] += 1
        workers[picked.worker_id] = dataclasses.replace(picked, num_unseen=picked.num_unseen + 1)
    assert counts == {"big": 8, "small": 4}


def test_a_worker_above_the_kv_threshold_is_skipped_even_when_idle() -> None:
    hot_but_idle = Candidate(worker_id="hot", capacity=4, kv_usage=0.95)
    busy = Candidate(worker_id="busy", capacity=4, num_running=4, num_waiting=40, kv_usage=0.5)
    # The idle one scores better, yet it must not get the request.
    assert score(hot_but_idle, 1, WEIGHTS) < score(busy, 1, WEIGHTS)
    for order in ([hot_but_idle, busy], [busy, hot_but_idle]):
        picked = choose(order, 1, WEIGHTS)
        assert picked is not None and picked.worker_id == "busy"


def test_a_worker_exactly_at_the_threshold_is_still_eligible() -> None:
    hot = Candidate(worker_id="hot", capacity=4, kv_usage=0.91)
    at = Candidate(worker_id="at", capacity=4, num_running=4, num_waiting=20, kv_usage=0.9)
    picked = choose([hot, at], 0, WEIGHTS)
    assert picked is not None and picked.worker_id == "at"


def test_when_every_worker_is_above_the_threshold_the_best_score_wins() -> None:
    fuller = Candidate(worker_id="a", capacity=4, kv_usage=0.99)  # 5 * 0.09 = 0.45
    less_full = Candidate(worker_id="b", capacity=4, num_running=2, kv_usage=0.95)  # 0.25 + 0.1
    busiest = Candidate(worker_id="c", capacity=4, num_waiting=8, kv_usage=0.92)  # 0.1 + 0.6
    picked = choose([fuller, less_full, busiest], 2, WEIGHTS)
    assert picked is not None and picked.worker_id == "b"


def test_score_formula_on_concrete_numbers() -> None:
    candidate = Candidate(
        worker_id="w", capacity=8, num_running=4, num_waiting=2, num_unseen=2, kv_usage=0.95
    )
    # 5·(0.95-0.9) + 0.3·(2+2)/8 + 0.2·4/8 - bonus
    assert score(candidate, 0, WEIGHTS) == pytest.approx(0.25 + 0.15 + 0.1 - 0.1)
    assert score(candidate, 1, WEIGHTS) == pytest.approx(0.25 + 0.15 + 0.1 - 0.05)
    assert score(candidate, 2, WEIGHTS) == pytest.approx(0.25 + 0.15 + 0.1)

    weights = RoutingWeights(
        kv=2.0, queue=1.0, load=0.5, kv_threshold=0.5, priority_bonus=(1.0, 0.5, 0.25)
    )
    other = Candidate(
        worker_id="w", capacity=10, num_running=3, num_waiting=1, num_unseen=4, kv_usage=0.8
    )
    # 2·0.3 + 1·5/10 + 0.5·3/10 - 0.5
    assert score(other, 1, weights) == pytest.approx(0.6 + 0.5 + 0.15 - 0.5)


def test_score_ignores_kv_below_the_threshold_and_guards_zero_capacity() -> None:
    low = Candidate(worker_id="w", capacity=4, kv_usage=0.3)
    assert score(low, 2, WEIGHTS) == pytest.approx(0.0)
    zero_capacity = Candidate(worker_id="w", capacity=0, num_running=1, num_waiting=1)
    # Capacity 0 counts as 1: 0.3·1 + 0.2·1
    assert score(zero_capacity, 2, WEIGHTS) == pytest.approx(0.5)


def test_priority_shifts_the_score_but_not_the_winner() -> None:
    a = Candidate(worker_id="a", capacity=4, num_running=1)
    b = Candidate(worker_id="b", capacity=4, num_running=2)
    winners = set()
    for priority in (0, 1, 2):
        picked = choose([b, a], priority, WEIGHTS)
        assert picked is not None
        winners.add(picked.worker_id)
    assert winners == {"a"}
    assert score(a, 0, WEIGHTS) < score(a, 1, WEIGHTS) < score(a, 2, WEIGHTS)


AFFINITY = RoutingWeights(queue=1.0, load=0.0, affinity_margin=0.25)


def test_affinity_keeps_the_previous_worker_within_the_margin() -> None:
    idle = Candidate(worker_id="idle", capacity=4)
    previous = Candidate(worker_id="prev", capacity=4, num_waiting=1)  # exactly 0.25 worse
    picked = choose([idle, previous], 2, AFFINITY, previous="prev")
    assert picked is not None and picked.worker_id == "prev"
    # Without affinity the better worker wins.
    picked = choose([idle, previous], 2, AFFINITY)
    assert picked is not None and picked.worker_id == "idle"


def test_affinity_is_abandoned_when_worse_by_more_than_the_margin() -> None:
    idle = Candidate(worker_id="idle", capacity=4)
    previous = Candidate(worker_id="prev", capacity=4, num_waiting=2)  # 0.5 worse
    picked = choose([idle, previous], 2, AFFINITY, previous="prev")
    assert picked is not None and picked.worker_id == "idle"


def test_affinity_to_the_best_worker_is_simply_the_best() -> None:
    best = Candidate(worker_id="prev", capacity=4)
    other = Candidate(worker_id="other", capacity=4, num_waiting=3)
    picked = choose([other, best], 2, AFFINITY, previous="prev")
    assert picked is not None and picked.worker_id == "prev"


def test_affinity_to_a_worker_not_among_candidates_is_ignored() -> None:
    a = Candidate(worker_id="a", capacity=4, num_waiting=1)
    b = Candidate(worker_id="b", capacity=4)
    picked = choose([a, b], 2, AFFINITY, previous="gone")
    assert picked is not None and picked.worker_id == "b"


def test_affinity_does_not_override_the_kv_threshold() -> None:
    cool = Candidate(worker_id="cool", capacity=4)
    previous = Candidate(worker_id="prev", capacity=4, kv_usage=0.91)  # only 0.05 worse
    assert score(previous, 2, AFFINITY) - score(cool, 2, AFFINITY) < AFFINITY.affinity_margin
    picked = choose([cool, previous], 2, AFFINITY, previous="prev")
    assert picked is not None and picked.worker_id == "cool"


def test_no_candidates_means_no_worker() -> None:
    assert choose([], 1, WEIGHTS) is None
    assert choose([], 1, WEIGHTS, previous="w1") is None


WORKER_IDS = ["a", "b", "c", "d", "e", "f"]

candidates_st = st.lists(
    st.builds(
        Candidate,
        worker_id=st.sampled_from(WORKER_IDS),
        capacity=st.integers(0, 64),
        num_running=st.integers(0, 64),
        num_waiting=st.integers(0, 64),
        num_unseen=st.integers(0, 64),
        kv_usage=st.one_of(
            st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.floats(0.0, 1.0, allow_nan=False)
        ),
    ),
    min_size=1,
    max_size=len(WORKER_IDS),
    unique_by=lambda c: c.worker_id,
)

weights_st = st.builds(
    RoutingWeights,
    kv=st.floats(0.0, 10.0),
    queue=st.floats(0.0, 2.0),
    load=st.floats(0.0, 2.0),
    kv_threshold=st.sampled_from([0.0, 0.5, 0.9, 1.0]) | st.floats(0.0, 1.0),
    priority_bonus=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    affinity_margin=st.floats(0.0, 1.0),
)


def every_choice(test: Callable[..., None]) -> Callable[..., None]:
    """``test(candidates, priority, weights, previous)``, over 300 of them."""
    return settings(max_examples=300, deadline=None)(
        given(
            candidates=candidates_st,
            priority=st.integers(0, 2),
            weights=weights_st,
            previous=st.none() | st.sampled_from([*WORKER_IDS, "missing"]),
        )(test)
    )


@every_choice
def test_choice_is_a_candidate_and_respects_the_threshold(
    candidates: list[Candidate], priority: int, weights: RoutingWeights, previous: str | None
) -> None:
    picked = choose(candidates, priority, weights, previous=previous)
    assert picked is not None
    assert picked in candidates
    below = [c for c in candidates if c.kv_usage <= weights.kv_threshold]
    if below:
        assert picked.kv_usage <= weights.kv_threshold
    eligible = below or candidates
    best = min(score(c, priority, weights) for c in eligible)
    picked_score = score(picked, priority, weights)
    if picked.worker_id != previous:
        assert picked_score == best
    else:
        assert picked_score <= best + weights.affinity_margin


@settings(max_examples=300, deadline=None)
@given(candidates=candidates_st, priority=st.integers(0, 2), weights=weights_st)
def test_without_affinity_the_choice_has_the_minimal_eligible_score(
    candidates: list[Candidate], priority: int, weights: RoutingWeights
) -> None:
    picked = choose(candidates, priority, weights, previous=None)
    assert picked is not None and picked in candidates
    below = [c for c in candidates if c.kv_usage <= weights.kv_threshold]
    eligible = below or candidates
    assert picked in eligible
    assert score(picked, priority, weights) == min(score(c, priority, weights) for c in eligible)


@every_choice
def test_the_choice_is_the_rankings_first_or_the_previous_worker_within_the_margin(
    candidates: list[Candidate], priority: int, weights: RoutingWeights, previous: str | None
) -> None:
    """The rule, ties included: eligible workers ranked by (score, worker id); the
    previous worker if it is ranked within the margin of the first, else the first."""
    below = [c for c in candidates if c.kv_usage <= weights.kv_threshold]
    ranked = sorted(below or candidates, key=lambda c: (score(c, priority, weights), c.worker_id))
    best = score(ranked[0], priority, weights)
    expected = next(
        (
            c
            for c in ranked
            if c.worker_id == previous
            and score(c, priority, weights) <= best + weights.affinity_margin
        ),
        ranked[0],
    )
    assert choose(candidates, priority, weights, previous=previous) is expected
