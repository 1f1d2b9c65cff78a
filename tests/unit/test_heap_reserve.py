"""tokenbus.heap_reserve: memory freed after a batch is reused, not faulted in again."""

from __future__ import annotations

import resource

from tokenbus.heap_reserve import reserve_heap

PAGE = resource.getpagesize()


def _faults_of_a_batch(mib: int) -> int:
    """Minor page faults while ``mib`` MiB of small objects (lists, not the reserve's
    ``bytes``) are allocated, then freed."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    batch = [[] for _ in range((mib << 20) // 64)]  # type: ignore[var-annotated]
    del batch
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_batch_within_the_reserve_faults_in_almost_nothing() -> None:
    pages = (16 << 20) // PAGE
    assert _faults_of_a_batch(16) > pages // 2  # fresh arenas each time, without one

    pins = reserve_heap(48)

    assert len(pins) >= 48 * 3  # at least three per arena
    assert _faults_of_a_batch(16) < pages // 10
    assert _faults_of_a_batch(16) < pages // 10  # and again: the batch's arenas stayed
    del pins


def test_zero_reserves_nothing() -> None:
    assert reserve_heap(0) == []
