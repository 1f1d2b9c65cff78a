"""bench.fetch_legs pairs each record's lines from bench/fetchwatch into its legs."""

from __future__ import annotations

import pytest

from bench.fetch_legs import legs

LINES = [
    "R 99.990000 100.010000 0 21",
    "R 100.010000 100.018000 1 21",
    "R 100.000000 100.500000 1 1",  # another consumer's one-partition fetch: left out
    "F tokenbus.requests.p1 3 7 100000 100.018000",
    "A tokenbus.requests.p1 3 7 100.018500",
    "P req_a 100.019000",
    "F tokenbus.requests.p1 4 0 100050 100.060000",
    "F tokenbus.requests.p1 4 0 100050 100.070000",  # fetched again: the first counts
    "A tokenbus.requests.p1 4 0 100.061000",
    "P req_b 100.061250",
]


def test_each_record_has_its_legs_in_ms() -> None:
    found = legs(LINES, first=100)
    assert found["sent → handed over"] == pytest.approx([18.0, 10.0], abs=1e-3)
    assert found["handed over → admitted"] == pytest.approx([0.5, 1.0], abs=1e-3)
    assert found["admitted → picked"] == pytest.approx([0.5, 0.25], abs=1e-3)
    assert found["fetch with records"] == pytest.approx([8.0], abs=1e-3)
    assert found["fetch without"] == pytest.approx([20.0], abs=1e-3)


def test_only_the_first_records_count() -> None:
    assert len(legs(LINES, first=1)["sent → handed over"]) == 1
