"""The bytes of batch input files a bridge checks at once, bounded. Pure.

A batch create reads its file a line at a time, but checking it still costs a thread,
a share of the interpreter the interactive requests run on, and memory in proportion to
the file's longest line; a bridge serves every tenant, so the creates of all of them
together are bounded, not only one create per tenant (``bridge.batch_api``).

A file is let in while the bytes taken stay within the limit. A file larger than the
whole limit is let in when nothing else is taken, so the largest file a tenant may
upload can always be created, just not beside another.
"""

from __future__ import annotations


class ByteBudget:
    def __init__(self, limit: int) -> None:
        """``limit`` bytes at once; 0 for no limit."""
        if limit < 0:
            raise ValueError("limit must be >= 0")
        self._limit = limit
        self.num_taken = 0

    def try_take(self, num_bytes: int) -> bool:
        """Takes ``num_bytes`` if they fit (give them back with ``give_back``)."""
        fits = self._limit == 0 or self.num_taken + num_bytes <= self._limit
        if fits or self.num_taken == 0:
            self.num_taken += num_bytes
            return True
        return False

    def give_back(self, num_bytes: int) -> None:
        if num_bytes > self.num_taken:
            raise ValueError(f"{num_bytes} bytes given back, {self.num_taken} taken")
        self.num_taken -= num_bytes
