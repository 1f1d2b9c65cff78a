from __future__ import annotations

import pytest

from bench.idle import cores


def test_cores_are_cpu_seconds_per_second_per_service_with_their_total() -> None:
    spent = {"broker": 8.0, "job": 2.0, "worker-0": 1.0}
    assert cores(spent, 40.0) == {
        "broker": 0.2,
        "job": 0.05,
        "worker-0": 0.025,
        "total": 0.275,
    }


def test_a_restarted_service_counts_nothing_rather_than_less_than_nothing() -> None:
    assert cores({"job": -4.0}, 10.0) == pytest.approx({"job": 0.0, "total": 0.0})
