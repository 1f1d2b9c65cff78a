from __future__ import annotations

import random

from schemas import WorkerStatus
from stream_jobs.registry import WorkerRegistry, WorkerView
from stream_jobs.routing import Candidate


def status(
    worker_id: str,
    *,
    incarnation: str = "run-1",
    model: str = "m",
    running: int = 0,
    waiting: int = 0,
    capacity: int = 4,
    kv: float = 0.0,
    draining: bool = False,
) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        model=model,
        request_topic=f"t.{worker_id}",
        num_running=running,
        num_waiting=waiting,
        max_num_seqs=capacity,
        kv_cache_usage=kv,
        draining=draining,
        incarnation=incarnation,
    )


def ids(views: list[WorkerView]) -> set[str]:
    return {view.status.worker_id for view in views}


def test_live_lists_the_workers_of_a_model() -> None:
    registry = WorkerRegistry()
    registry.observe(status("w1"), now=0.0)
    registry.observe(status("w2"), now=0.0)
    registry.observe(status("w3", model="other"), now=0.0)
    assert ids(registry.live("m", now=1.0)) == {"w1", "w2"}
    assert ids(registry.live("other", now=1.0)) == {"w3"}
    assert registry.live("nope", now=1.0) == []
    assert ids(registry.all_live(now=1.0)) == {"w1", "w2", "w3"}


def test_silent_and_draining_workers_are_not_live() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("old"), now=0.0)
    registry.observe(status("leaving", draining=True), now=5.0)
    registry.observe(status("fresh", model="other"), now=4.0)
    assert registry.live("m", now=5.0) == []
    assert ids(registry.all_live(now=5.0)) == {"fresh"}


def test_a_worker_is_live_until_dead_after_s_of_silence() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("w1"), now=10.0)
    assert ids(registry.live("m", now=12.9)) == {"w1"}
    assert registry.live("m", now=13.0) == []
    registry.observe(status("w1"), now=12.0)  # a heartbeat in time keeps it live
    assert ids(registry.live("m", now=14.5)) == {"w1"}


def test_models_are_those_of_live_workers() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("w1", model="a"), now=0.0)
    registry.observe(status("w2", model="b"), now=2.0)
    registry.observe(status("w3", model="b"), now=2.0)
    registry.observe(status("w4", model="c", draining=True), now=2.0)
    assert registry.models(now=2.0) == {"a", "b"}
    assert registry.models(now=4.0) == {"b"}
    assert registry.models(now=9.0) == set()


def reap_until(registry: WorkerRegistry, start: float, end: float) -> list[tuple[str, str]]:
    """Calls reap every 50 ms, as the dispatch loop does, and collects what it hands out."""
    gone: list[tuple[str, str]] = []
    for step in range(round((end - start) / 0.05) + 1):
        gone += registry.reap(now=start + step * 0.05)
    return gone


def test_reap_returns_a_silent_run_once() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("w1", incarnation="a"), now=0.0)
    registry.observe(status("w2", incarnation="b"), now=2.0)
    assert reap_until(registry, 0.0, 2.9) == []
    assert reap_until(registry, 2.95, 3.0) == [("w1", "a")]
    assert reap_until(registry, 3.05, 10.0) == [("w2", "b")]
    assert reap_until(registry, 10.05, 20.0) == []
    assert registry.get("w1") is None and registry.get("w2") is None


def test_a_stall_of_the_caller_is_not_held_against_the_workers() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("w1"), now=0.0)
    assert reap_until(registry, 0.0, 2.0) == []
    # The caller's loop was blocked for 2.5 s: heartbeats waited, unread.
    assert registry.reap(now=4.5) == []
    registry.observe(status("w1"), now=4.6)  # the backlog is read at last
    assert reap_until(registry, 4.6, 7.0) == []
    assert [v.status.worker_id for v in registry.live("m", now=7.0)] == ["w1"]


def test_a_draining_worker_that_still_reports_is_not_reaped() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    for now in (0.0, 2.0, 4.0, 6.0):
        registry.observe(status("w1", draining=True), now=now)
        assert registry.reap(now=now + 0.5) == []
    assert registry.get("w1") is not None


def test_a_new_incarnation_reaps_the_old_run_at_once() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("w1", incarnation="a"), now=0.0)
    registry.observe(status("w1", incarnation="b"), now=0.5)
    assert registry.reap(now=0.5) == [("w1", "a")]
    assert registry.reap(now=0.6) == []
    view = registry.get("w1")
    assert view is not None and view.key == ("w1", "b")
    assert [v.key for v in registry.live("m", now=0.6)] == [("w1", "b")]


def test_a_run_presumed_dead_that_reports_again_is_live_again() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("w1", incarnation="a"), now=0.0)
    assert reap_until(registry, 0.0, 3.5) == [("w1", "a")]
    assert registry.live("m", now=3.5) == []
    registry.observe(status("w1", incarnation="a"), now=3.6)  # it was only slow
    assert [v.key for v in registry.live("m", now=3.6)] == [("w1", "a")]
    assert reap_until(registry, 3.6, 5.0) == []  # not handed out a second time


def test_the_old_run_cannot_displace_its_successor() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("w1", incarnation="a"), now=0.0)
    registry.observe(status("w1", incarnation="b", running=2), now=1.0)
    assert registry.reap(now=1.0) == [("w1", "a")]
    registry.observe(status("w1", incarnation="a"), now=1.5)  # a late heartbeat of the old run
    view = registry.get("w1")
    assert view is not None and view.key == ("w1", "b") and view.status.num_running == 2
    assert registry.reap(now=1.5) == []


def test_note_dispatch_counts_until_the_next_heartbeat() -> None:
    registry = WorkerRegistry()
    registry.observe(status("w1", running=1, capacity=4), now=0.0)
    for _ in range(3):
        registry.note_dispatch("w1")
    view = registry.get("w1")
    assert view is not None
    assert view.num_unseen_dispatches == 3
    assert view.load == 1.0
    assert view.candidate().num_unseen == 3

    registry.observe(status("w1", running=2, waiting=1, capacity=4), now=0.5)
    view = registry.get("w1")
    assert view is not None
    assert view.num_unseen_dispatches == 0
    assert view.load == 0.75


def test_note_dispatch_to_an_unknown_worker_is_a_no_op() -> None:
    registry = WorkerRegistry()
    registry.observe(status("w1"), now=0.0)
    registry.note_dispatch("ghost")
    assert registry.get("ghost") is None
    view = registry.get("w1")
    assert view is not None and view.num_unseen_dispatches == 0


def test_candidate_maps_the_heartbeat_fields() -> None:
    view = WorkerView(
        status=status("w7", running=3, waiting=2, capacity=16, kv=0.42),
        seen_at=0.0,
        num_unseen_dispatches=5,
    )
    assert view.candidate() == Candidate(
        worker_id="w7",
        capacity=16,
        num_running=3,
        num_waiting=2,
        num_unseen=5,
        kv_usage=0.42,
    )


def test_a_silent_run_is_reaped_even_when_every_reap_comes_late() -> None:
    # The caller's loop lags 0.6 s at every turn (each gap counts as its own stall),
    # but it reads the other worker's heartbeats: the silent one is gone after 3 s of them.
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("alive"), now=0.0)
    registry.observe(status("dead"), now=0.0)
    gone: list[tuple[str, str]] = []
    now = 0.0
    while now < 5.0 and not gone:
        now += 0.6
        registry.observe(status("alive"), now=now)
        gone = registry.reap(now)
    assert gone == [("dead", "run-1")] and 3.0 <= now < 4.0
    assert ids(registry.all_live(now)) == {"alive"}


def naive_live(registry: WorkerRegistry, now: float) -> list[tuple[str, str]]:
    """The live set worked out afresh from the views, as ``all_live`` did before it
    kept its answer between changes."""
    return [
        view.key
        for view in registry._workers.values()
        if not view.status.draining and now - view.seen_at < registry.dead_after_s
    ]


def test_the_kept_live_set_matches_a_fresh_one_through_heartbeats_reaps_and_time() -> None:
    rng = random.Random(17)
    registry = WorkerRegistry(dead_after_s=3.0)
    now = 0.0
    for _ in range(5_000):
        now += rng.choice([0.0, 0.01, 0.1, 0.7, 1.5, 2.999, 3.0])
        action = rng.random()
        worker = f"w{rng.randrange(4)}"
        if action < 0.2:
            registry.observe(
                status(
                    worker,
                    incarnation=f"run-{rng.randrange(2)}",
                    model=rng.choice(["m", "n"]),
                    capacity=rng.randrange(1, 9),
                    draining=rng.random() < 0.2,
                ),
                now=now,
            )
        elif action < 0.3:
            registry.reap(now)
        expected = naive_live(registry, now)
        assert [view.key for view in registry.all_live(now)] == expected
        for model in ("m", "n"):
            assert [view.key for view in registry.live(model, now)] == [
                view.key
                for view in registry._workers.values()
                if view.key in expected and view.status.model == model
            ]
        assert registry.capacity(now) == sum(
            view.status.max_num_seqs for view in registry._workers.values() if view.key in expected
        )


def test_the_live_set_is_worked_out_again_when_the_clock_reads_earlier() -> None:
    registry = WorkerRegistry(dead_after_s=3.0)
    registry.observe(status("w1"), now=10.0)
    assert ids(registry.all_live(now=12.0)) == {"w1"}
    assert registry.capacity(now=13.0) == 0  # silent for 3 s: gone
    assert registry.capacity(now=12.5) == 4  # an earlier reading (tests move clocks)


def test_a_candidate_is_made_once_until_a_dispatch_or_a_heartbeat_changes_it() -> None:
    registry = WorkerRegistry()
    registry.observe(status("w1", running=2), now=0.0)
    (view,) = registry.live("m", 0.0)
    first = view.candidate()
    assert view.candidate() is first  # a pick of every live worker makes none again

    registry.note_dispatch("w1", None, now=0.1)
    registry.note_dispatch("w1", "lora-a", now=0.2)
    after = view.candidate()
    assert after is not first
    assert (after.num_unseen, after.adapters) == (2, frozenset({"lora-a"}))
    assert view.candidate() is after

    registry.observe(status("w1", running=3), now=0.3)
    (fresh,) = registry.live("m", 0.3)
    assert (fresh.candidate().num_running, fresh.candidate().num_unseen) == (3, 0)
    assert fresh.candidate().adapters == {"lora-a"}  # sent, not yet listed: held
