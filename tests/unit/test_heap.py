"""tokenbus.heap: start-up's objects leave the cycle collector's generations."""

from __future__ import annotations

import gc

from tokenbus.heap import freeze_startup_heap


def test_start_ups_objects_are_frozen_and_later_collections_skip_them() -> None:
    kept = [object() for _ in range(1000)]
    try:
        frozen = freeze_startup_heap("test")
        assert frozen == gc.get_freeze_count() and frozen >= len(kept)
        before = sum(len(gc.get_objects(generation)) for generation in range(3))
        assert before < frozen  # the generations a collection walks hold less than was frozen
    finally:
        gc.unfreeze()
