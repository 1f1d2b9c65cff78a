from __future__ import annotations

from batches.control import Pace, Step, decide


def step(now: float = 100.0, *, cancel: bool = False, left: int = 5, running: int = 2) -> Step:
    return decide(
        now,
        expires_at=200.0,
        cancel_requested=cancel,
        num_left=left,
        num_in_flight=running,
        grace_s=30.0,
    )


def test_a_running_batch_dispatches() -> None:
    assert step() == Step(dispatch=True)


def test_all_lines_done_completes() -> None:
    assert step(left=0, running=0).end == "completed"
    assert step(left=0, running=0, cancel=True).end == "cancelled"


def test_cancel_stops_dispatching_and_waits_for_the_running_lines() -> None:
    waiting = step(cancel=True, running=2)
    assert (waiting.dispatch, waiting.status, waiting.end, waiting.abort_running) == (
        False,
        "cancelling",
        None,
        False,
    )
    assert step(cancel=True, running=0).end == "cancelled"


def test_expiry_aborts_the_running_lines_and_ends_within_the_grace() -> None:
    at_expiry = step(200.0, running=2)
    assert (at_expiry.dispatch, at_expiry.abort_running, at_expiry.end) == (False, True, None)
    assert step(229.0, running=2).end is None
    assert step(230.0, running=2).end == "expired"
    assert step(201.0, running=0).end == "expired"
    assert step(201.0, running=0, cancel=True).end == "expired"  # the window came first


def test_the_pace_gives_an_eta() -> None:
    pace = Pace(window_s=10)
    assert pace.eta_s(10) is None
    pace.observe(0.0, 0)
    pace.observe(5.0, 10)
    assert pace.lines_per_s() == 2.0
    assert pace.eta_s(10) == 5.0
    assert pace.eta_s(0) == 0.0
    pace.observe(30.0, 10)  # nothing done for a while: the old samples age out
    assert pace.lines_per_s() is None
