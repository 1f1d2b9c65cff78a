"""The seat reserve: how many requests the fleet may run at once, by class.

A pure policy over plain numbers. vLLM does not preempt a running request to seat a
waiting one of higher priority, so a class 0 request that found every seat taken would
wait for a batch request to finish. Classes 1 and 2 may therefore fill only the fleet's
seats less ``vip_reserve`` of them (rounded up); class 0 may fill every seat. At least one
request may always run, so a fleet of one small worker still serves every class.

Class 2 lines that are finishing above the batch yield's cap (``tokenbus.batch_yield``)
are not waited for by classes 0 and 1: their seats count as free for them, as long as
the fleet has a seat, so that an interactive request arriving at a fleet full of batch
lines starts at once rather than after one of them ends.
"""

from __future__ import annotations

import math

BATCH_CLASS = 2


def seats_for(priority: int, capacity: int, vip_reserve: float) -> int:
    """How many requests may be in flight when the next one is of ``priority``."""
    reserved = 0 if priority == 0 else math.ceil(capacity * vip_reserve)
    return max(1, capacity - reserved)


def has_room(
    priority: int,
    num_in_flight: int,
    capacity: int,
    vip_reserve: float,
    *,
    since_start_s: float,
    learn_fleet_s: float,
    num_yielding: int = 0,
) -> bool:
    """May a request of ``priority`` be forwarded now?

    ``capacity`` is the live fleet's seats (0: no worker known). Just after the job
    starts it waits ``learn_fleet_s`` to hear the fleet's heartbeats, rather than refuse
    what a live worker could serve; after that, no live worker means forwarding now, so
    that an interactive request is answered ``no_worker`` at once. Class 2 (batch) waits
    for a worker instead: batch lines wait, they do not fail (a client that gives up
    cancels, which drops the request from the queue).

    ``num_yielding``: class 2 requests in flight that are finishing above the batch
    yield's cap; a class 0/1 request does not count them, but still needs a free seat.
    """
    if capacity == 0:
        return priority < BATCH_CLASS and since_start_s >= learn_fleet_s
    if priority < BATCH_CLASS and num_yielding > 0:
        counted = num_in_flight - num_yielding
        return counted < seats_for(priority, capacity, vip_reserve) and num_in_flight < capacity
    return num_in_flight < seats_for(priority, capacity, vip_reserve)
