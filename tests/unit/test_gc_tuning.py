"""tokenbus.gc_tuning: what start-up made is frozen, the young generation collects later."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tokenbus.gc_tuning import tune_gc


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
def test_freezes_what_exists_and_raises_only_the_young_threshold() -> None:
    _, gen1, gen2 = gc.get_threshold()
    tune_gc(10_000)

    assert gc.get_threshold() == (10_000, gen1, gen2)
    assert gc.get_freeze_count() > 0
    frozen = gc.get_freeze_count()
    gc.collect()
    assert gc.get_freeze_count() == frozen  # a full collection leaves them alone


@pytest.mark.usefixtures("restored_gc")
def test_zero_leaves_the_collector_as_it_was() -> None:
    before = gc.get_threshold()

    tune_gc(0)

    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
