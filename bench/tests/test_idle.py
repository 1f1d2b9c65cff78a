from __future__ import annotations

import pytest

from bench.idle import cores


def test_cores_are_cpu_seconds_per_second_per_service_with_their_total() -> None:
    before = {"broker": 10.0, "job": 4.0}
    after = {"broker": 18.0, "job": 6.0, "worker-0": 1.0}  # a service first seen late
    assert cores(before, after, 40.0) == {
        "broker": 0.2,
        "job": 0.05,
        "worker-0": 0.025,
        "total": 0.275,
    }


def test_a_restarted_service_counts_nothing_rather_than_less_than_nothing() -> None:
    assert cores({"job": 5.0}, {"job": 1.0}, 10.0) == pytest.approx({"job": 0.0, "total": 0.0})
