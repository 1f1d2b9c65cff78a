"""Adapter-affine routing: held adapters win while their worker has room and scores well."""

from __future__ import annotations

from schemas import WorkerStatus
from stream_jobs.adapter_routing import choose_for_adapter, has_room
from stream_jobs.registry import ADAPTER_SENT_HOLD_S, WorkerRegistry
from stream_jobs.routing import Candidate, RoutingWeights

WEIGHTS = RoutingWeights()


def lora(worker_id: str, *adapters: str, running: int = 0, waiting: int = 0) -> Candidate:
    return Candidate(
        worker_id=worker_id,
        capacity=4,
        num_running=running,
        num_waiting=waiting,
        max_loras=2,
        adapters=frozenset(adapters),
    )


def pick(candidates: list[Candidate], adapter: str | None, previous: str | None = None) -> str:
    chosen = choose_for_adapter(candidates, 1, WEIGHTS, adapter=adapter, previous=previous)
    assert chosen is not None
    return chosen.worker_id


def test_a_worker_without_lora_never_gets_an_adapter_request() -> None:
    base_only = Candidate(worker_id="w0", capacity=64)
    assert choose_for_adapter([base_only], 1, WEIGHTS, adapter="a") is None
    assert pick([base_only, lora("w1", running=3)], "a") == "w1"


def test_the_base_model_routes_as_before() -> None:
    assert pick([lora("w1", "a", running=2), lora("w2")], None) == "w2"


def test_the_holder_wins_while_it_has_room_and_scores_within_the_margin() -> None:
    candidates = [lora("w1"), lora("w2", "a", running=2), lora("w3")]
    assert pick(candidates, "a") == "w2"


def test_a_saturated_holder_spreads_the_adapter_to_another_worker() -> None:
    full = lora("w2", "a", running=4)
    assert not has_room(full)
    assert pick([lora("w1", "b"), full, lora("w3")], "a") == "w3"  # the fewest adapters


def test_a_holder_scoring_too_badly_loses_even_with_room() -> None:
    slow = Candidate(
        worker_id="w2", capacity=100, num_waiting=99, max_loras=2, adapters=frozenset("a")
    )
    assert has_room(slow)
    assert pick([lora("w1"), slow], "a") == "w1"


def test_a_new_adapter_goes_to_the_least_crowded_cache() -> None:
    candidates = [lora("w1", "a", "b"), lora("w2", "c"), lora("w3", "d", "e")]
    assert pick(candidates, "f") == "w2"


def test_four_adapters_in_turn_spread_over_three_idle_workers() -> None:
    held: dict[str, set[str]] = {"w1": set(), "w2": set(), "w3": set()}
    for adapter in ("a", "b", "c", "d", "a", "b", "c", "d"):
        candidates = [lora(w, *names) for w, names in sorted(held.items())]
        held[pick(candidates, adapter)].add(adapter)
    assert sorted(len(names) for names in held.values()) == [1, 1, 2]
    assert all(sum(a in names for names in held.values()) == 1 for a in "abcd")


def test_the_session_worker_comes_first_within_the_affinity_margin() -> None:
    candidates = [lora("w1", "a"), lora("w2", running=1)]
    assert pick(candidates, "a", previous="w2") == "w2"
    far = [lora("w1", "a"), lora("w2", running=4, waiting=4)]
    assert pick(far, "a", previous="w2") == "w1"


def status(*adapters: str) -> WorkerStatus:
    return WorkerStatus(
        worker_id="w1",
        model="m",
        request_topic="t",
        max_num_seqs=4,
        max_loras=2,
        adapters=list(adapters),
        incarnation="run-1",
    )


def test_an_adapter_just_sent_counts_as_held_until_a_heartbeat_lists_it() -> None:
    registry = WorkerRegistry()
    registry.observe(status(), now=0.0)
    registry.note_dispatch("w1", "a", now=0.1)
    view = registry.get("w1")
    assert view is not None and view.candidate().adapters == {"a"}

    registry.observe(status(), now=0.5)  # not loaded yet: still held
    assert registry.live("m", 0.5)[0].candidate().adapters == {"a"}
    registry.observe(status(), now=0.1 + ADAPTER_SENT_HOLD_S)  # never loaded: forgotten
    assert registry.live("m", 0.1 + ADAPTER_SENT_HOLD_S)[0].candidate().adapters == set()


def test_held_adapters_come_from_the_heartbeat() -> None:
    registry = WorkerRegistry()
    registry.observe(status("a", "b"), now=0.0)
    assert registry.live("m", 0.0)[0].candidate().adapters == {"a", "b"}
