from __future__ import annotations

import pytest

from batches.pacer_fixed import FixedPacer
from batches.pacing import Pacer


def test_the_fixed_pacer_allows_its_limit_whatever_the_load() -> None:
    pacer: Pacer = FixedPacer(8)
    pacer.observe(object())
    assert pacer.limit() == 8
    with pytest.raises(ValueError):
        FixedPacer(0)
