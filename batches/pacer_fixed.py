"""The pacer contract, and a fixed one: how many lines a batch keeps in flight.

# job LoadReport (<prefix>.load) --> Pacer.observe ; runner --> Pacer.limit() --> dispatch

The runner asks ``limit()`` before each dispatch round and never has more lines of one
batch in flight than it says; ``observe`` gets every load report the job publishes, in
order. ``FixedPacer`` ignores them and allows ``Settings.batch_max_in_flight``: the
adaptive (AIMD) pacer, which backs off when interactive traffic waits, implements the
same protocol in ``batches.pacing``.
"""

from __future__ import annotations

from typing import Protocol


class Pacer(Protocol):
    def limit(self) -> int:
        """Lines allowed in flight now (at least 1)."""
        ...

    def observe(self, report: object) -> None:
        """A job load report arrived."""
        ...


class FixedPacer:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a pacer allows at least one line in flight")
        self._limit = limit

    def limit(self) -> int:
        return self._limit

    def observe(self, report: object) -> None:
        return None
