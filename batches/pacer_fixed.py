"""A fixed pacer: every batch keeps up to the same number of lines in flight.

# runner --> Pacer.limit() --> dispatch (the ``Pacer`` protocol is ``batches.pacing``'s)

For tests and for operators who want no adaptation: ``FixedPacer`` ignores the job's
load reports. The runner's default is the adaptive one (``batches.pacing.Shares`` over
an ``AimdPacer``), which backs off while interactive traffic waits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas import LoadReport


class FixedPacer:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a pacer allows at least one line in flight")
        self._limit = limit

    def limit(self) -> int:
        return self._limit

    def observe(self, report: LoadReport) -> None:
        return None
