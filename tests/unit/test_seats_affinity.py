"""The seat reserve (stream_jobs.seats) and session affinity (stream_jobs.affinity)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream_jobs.affinity import SessionAffinity
from stream_jobs.seats import has_room, seats_for


def test_classes_1_and_2_leave_the_reserve_to_class_0() -> None:
    assert seats_for(0, 10, 0.3) == 10
    assert seats_for(1, 10, 0.3) == seats_for(2, 10, 0.3) == 7
    assert seats_for(1, 11, 0.3) == 7  # 3.3 seats reserved: rounded up to 4
    assert has_room(1, 6, 10, 0.3, since_start_s=9, learn_fleet_s=3)
    assert not has_room(1, 7, 10, 0.3, since_start_s=9, learn_fleet_s=3)
    assert has_room(0, 9, 10, 0.3, since_start_s=9, learn_fleet_s=3)
    assert not has_room(0, 10, 10, 0.3, since_start_s=9, learn_fleet_s=3)


def test_one_request_always_runs_on_a_small_fleet() -> None:
    assert seats_for(2, 1, 0.9) == 1
    assert has_room(2, 0, 1, 0.9, since_start_s=9, learn_fleet_s=3)


def test_no_fleet_known_waits_one_heartbeat_period_then_lets_requests_through() -> None:
    assert not has_room(1, 0, 0, 0.3, since_start_s=1.0, learn_fleet_s=3.0)
    assert has_room(1, 0, 0, 0.3, since_start_s=3.0, learn_fleet_s=3.0)  # to no_worker


def test_with_no_live_worker_batch_requests_wait_for_one() -> None:
    for since_start_s in (1.0, 3.0, 3600.0):
        assert not has_room(2, 0, 0, 0.3, since_start_s=since_start_s, learn_fleet_s=3.0)
    assert has_room(2, 0, 1, 0.3, since_start_s=3600.0, learn_fleet_s=3.0)  # one came back


@given(
    st.integers(1, 1000),
    st.floats(0, 1, allow_nan=False),
    st.integers(0, 2),
)
def test_class_0_has_at_least_the_seats_of_any_class(
    capacity: int, reserve: float, priority: int
) -> None:
    assert 1 <= seats_for(priority, capacity, reserve) <= seats_for(0, capacity, reserve)
    assert seats_for(0, capacity, reserve) == capacity


def test_a_session_returns_to_its_last_worker_and_the_oldest_is_forgotten() -> None:
    affinity = SessionAffinity(max_sessions=2)
    affinity.note(("acme", "s1"), "w1")
    affinity.note(("acme", "s2"), "w2")
    assert affinity.previous(("acme", "s1")) == "w1"
    affinity.note(("acme", "s1"), "w3")  # s1 is now the most recent
    affinity.note(("acme", "s3"), "w1")  # s2, the least recent, goes
    assert affinity.previous(("acme", "s2")) is None
    assert affinity.previous(("acme", "s1")) == "w3" and len(affinity) == 2


def test_sessions_are_the_tenants_own() -> None:
    affinity = SessionAffinity(max_sessions=10)
    affinity.note(("acme", "s1"), "w1")
    assert affinity.previous(("globex", "s1")) is None


def test_a_lost_workers_sessions_are_forgotten() -> None:
    affinity = SessionAffinity(max_sessions=10)
    for n, worker in enumerate(["w1", "w2", "w1"]):
        affinity.note(("acme", f"s{n}"), worker)
    assert affinity.forget_worker("w1") == 2
    assert affinity.previous(("acme", "s1")) == "w2" and len(affinity) == 1


def test_the_bound_must_hold_at_least_one_session() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SessionAffinity(0)


def test_class_0_and_1_do_not_wait_for_batch_lines_above_the_yield_cap() -> None:
    # 64 seats, 44 for classes 1 and 2, all held by batch lines of which 40 are above the
    # yield's cap: class 1 goes beside them, as long as the fleet has a seat at all.
    assert not has_room(1, 44, 64, 0.3, since_start_s=9, learn_fleet_s=3)
    assert has_room(1, 44, 64, 0.3, since_start_s=9, learn_fleet_s=3, num_yielding=40)
    assert not has_room(1, 48, 64, 0.3, since_start_s=9, learn_fleet_s=3, num_yielding=4)
    assert not has_room(1, 64, 64, 0.3, since_start_s=9, learn_fleet_s=3, num_yielding=40)
    assert has_room(0, 63, 64, 0.3, since_start_s=9, learn_fleet_s=3, num_yielding=40)
    # Class 2 itself never counts them out: they are its own.
    assert not has_room(2, 44, 64, 0.3, since_start_s=9, learn_fleet_s=3, num_yielding=40)
