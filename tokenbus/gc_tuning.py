"""The cyclic garbage collector of a long-running service, set for a hot path that
allocates many short-lived objects.

# after start-up --> freeze what exists (modules, the app) --> young generation of N

CPython collects its youngest generation after every 700 net allocations of tracked
objects, and every such collection also walks whatever survived since the last one; a
full collection walks every object alive, the whole import graph included. A bridge
streaming at c=64 allocates chunks, events, futures and ASGI messages per token, and
spent about a tenth of its CPU in the collector (``gc.callbacks``, BENCHMARKS.md).
Nearly all of those objects die by reference counting, so collecting less often costs
little memory: what a young collection finds is the live in-flight state, whatever the
threshold. Freezing what start-up made (``gc.freeze``, as CPython's documentation
advises for long-running processes) keeps it out of every later collection.
"""

from __future__ import annotations

import gc


def tune_gc(gen0_threshold: int) -> None:
    """Freezes the objects alive now and collects the young generation after
    ``gen0_threshold`` allocations (0: leave CPython's thresholds and freeze nothing).
    Call once, from a process's entry point, after its app is built."""
    if gen0_threshold <= 0:
        return
    gc.collect()  # nothing that is garbage now is frozen with the rest
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
