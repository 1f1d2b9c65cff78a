"""tokenbus.heap: start-up's objects leave the cycle collector's generations, and the
young generation collects later."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from tokenbus.config import Settings
from tokenbus.heap import freeze_startup_heap


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
def test_start_ups_objects_are_frozen_and_later_collections_skip_them() -> None:
    kept = [object() for _ in range(1000)]
    frozen = freeze_startup_heap("test")
    assert frozen == gc.get_freeze_count() and frozen >= len(kept)
    before = sum(len(gc.get_objects(generation)) for generation in range(3))
    assert before < frozen  # the generations a collection walks hold less than was frozen
    gc.collect()
    assert gc.get_freeze_count() == frozen  # a full collection leaves them alone


@pytest.mark.usefixtures("restored_gc")
def test_a_threshold_raises_only_the_young_generations() -> None:
    _, gen1, gen2 = gc.get_threshold()

    freeze_startup_heap("test", 10_000)

    assert gc.get_threshold() == (10_000, gen1, gen2)


@pytest.mark.usefixtures("restored_gc")
def test_zero_leaves_the_thresholds_as_they_were() -> None:
    before = gc.get_threshold()

    freeze_startup_heap("test", 0)

    assert gc.get_threshold() == before


@pytest.mark.parametrize("threshold", [-1, 2**31])
def test_a_threshold_the_collector_cannot_take_is_refused_with_the_settings(
    threshold: int,
) -> None:
    # 2**31 would reach gc.set_threshold and end the service at start with an
    # OverflowError; the settings refuse it first, naming the field.
    with pytest.raises(ValidationError, match="gc_gen0_threshold"):
        Settings(gc_gen0_threshold=threshold)
