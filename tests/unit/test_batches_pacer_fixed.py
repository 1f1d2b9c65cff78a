from __future__ import annotations

import pytest

from batches.pacer_fixed import FixedPacer
from batches.pacing import Pacer
from schemas import LoadReport


def test_the_fixed_pacer_allows_its_limit_whatever_the_load() -> None:
    pacer: Pacer = FixedPacer(8)
    pacer.observe(
        LoadReport(model="m", instance="job-1", interval_s=1.0, num_waiting_by_class=[9, 9, 9])
    )
    assert pacer.limit() == 8
    with pytest.raises(ValueError):
        FixedPacer(0)
