from __future__ import annotations

import os

import pytest

from bench import machine


def test_a_round_trip_costs_more_wall_time_than_nothing_and_leaves_affinity_alone() -> None:
    before = os.sched_getaffinity(0)
    wall_us, cpu_us = machine.ping_pong(200, (0, 0))
    assert wall_us > 0
    assert 0 <= cpu_us <= wall_us * 1.5  # one side's CPU cannot much exceed the wall time
    assert os.sched_getaffinity(0) == before
    slow_wall_us, _ = machine.ping_pong(20, (0, 0), delay_s=0.001)
    assert slow_wall_us >= 1000  # each round trip waits out the other side's sleep


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to cross")
def test_measure_gives_every_floor_with_its_spread() -> None:
    floors = machine.measure(round_trips=100, repeat=2)
    for side in ("cross_core", "same_core", "idle_wake"):
        for field in ("wall_us", "cpu_us"):
            figure = floors[side][field]
            assert figure["min"] <= figure["median"] <= figure["max"]
            assert figure["max"] > 0
    assert floors["syscall_ns"]["median"] > 0
    assert floors["python_us"]["median"] > 0


def test_counts_below_one_are_refused() -> None:
    with pytest.raises(SystemExit):
        machine.main(["--repeat", "0"])
