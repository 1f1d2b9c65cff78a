"""bench.route_cost picks among the fleet it names, as the dispatcher does."""

from __future__ import annotations

from bench.route_cost import MODEL, fleet, picks, us_per_pick


def test_the_fleet_has_the_workers_asked_for() -> None:
    assert len(fleet(37).live(MODEL, 0.0)) == 37


def test_picks_go_to_several_workers_and_count_their_dispatches() -> None:
    registry = fleet(8)
    counts = picks(registry, 400)  # ten sessions, each kept near its previous worker
    assert sum(counts.values()) == 400 and len(counts) > 1
    assert sum(view.num_unseen_dispatches for view in registry.live(MODEL, 1.0)) == 400


def test_a_point_times_some_work() -> None:
    assert us_per_pick(4, 200) > 0
