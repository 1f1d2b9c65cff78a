"""Priority classes, and weighted fair sharing within a class by Virtual Token Counter.

Class 0 is served before class 1, and class 1 before class 2. Within a class, the next
request comes from the backlogged tenant with the smallest counter (VTC, Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024):

- a tenant's counter is charged ``(input tokens + 2 * output tokens) / weight``: the
  estimate when its request is dispatched, corrected to the real count when it ends;
- a tenant that returns from idle has its counter lifted to the smallest counter among
  the backlogged tenants, so idling earns no credit to burst with later.

Pure: no clock, no I/O. Requests within one tenant stay in arrival order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
OUTPUT_COST = 2.0
NUM_CLASSES = 3


def token_cost(num_input: int, num_output: int, weight: float) -> float:
    return (num_input + OUTPUT_COST * num_output) / weight


@dataclass
class _Entry(Generic[T]):
    key: str
    item: T
    num_input: int
    num_output: int
    filler: bool = False


@dataclass
class _ClassQueue(Generic[T]):
    counters: dict[str, float] = field(default_factory=dict)
    backlog: dict[str, deque[_Entry[T]]] = field(default_factory=dict)

    def push(self, tenant: str, entry: _Entry[T]) -> None:
        queue = self.backlog.get(tenant)
        if queue is None:
            # Returning from idle: no credit for the time away.
            floor = min((self.counters[t] for t in self.backlog), default=None)
            current = self.counters.get(tenant, 0.0)
            self.counters[tenant] = current if floor is None else max(current, floor)
            queue = self.backlog[tenant] = deque()
        queue.append(entry)

    def next_tenant(self) -> str | None:
        if not self.backlog:
            return None
        return min(self.backlog, key=lambda t: (self.counters[t], t))

    def pop(self, weights: dict[str, float]) -> tuple[str, _Entry[T]] | None:
        tenant = self.next_tenant()
        if tenant is None:
            return None
        queue = self.backlog[tenant]
        entry = queue.popleft()
        if not queue:
            del self.backlog[tenant]
        weight = weights.get(tenant, 1.0)
        self.counters[tenant] += token_cost(entry.num_input, entry.num_output, weight)
        return tenant, entry


class FairQueue(Generic[T]):
    """Waiting requests, dequeued by class, then by weighted fair share within the class."""

    def __init__(self) -> None:
        self._classes: list[_ClassQueue[T]] = [_ClassQueue() for _ in range(NUM_CLASSES)]
        self._weights: dict[str, float] = {}
        self._where: dict[str, tuple[int, str]] = {}  # key -> (class, tenant)
        self._num_filler = 0

    def __len__(self) -> int:
        return len(self._where)

    @property
    def num_filler(self) -> int:
        """Waiting requests pushed as ``filler``: work that fills idle seats and waits for
        them (a batch job's lines), not demand the fleet is short of."""
        return self._num_filler

    def num_waiting(self, priority: int) -> int:
        return sum(len(q) for q in self._classes[priority].backlog.values())

    def push(
        self,
        key: str,
        item: T,
        *,
        tenant: str,
        priority: int,
        weight: float,
        num_input: int,
        num_output: int,
        filler: bool = False,
    ) -> None:
        """Queues ``item``; ``num_output`` is the estimate (max_tokens) charged at dispatch."""
        self._weights[tenant] = weight
        self._classes[priority].push(tenant, _Entry(key, item, num_input, num_output, filler))
        self._where[key] = (priority, tenant)
        self._num_filler += filler

    def pop(self, max_priority: int = NUM_CLASSES - 1) -> T | None:
        """The next request of class ``<= max_priority``, or None."""
        for priority in range(max_priority + 1):
            popped = self._classes[priority].pop(self._weights)
            if popped is not None:
                _, entry = popped
                del self._where[entry.key]
                self._num_filler -= entry.filler
                return entry.item
        return None

    def peek(self, priority: int) -> T | None:
        """The request ``pop(priority)`` would return if the classes before it are empty,
        left in place and uncharged."""
        tenant = self._classes[priority].next_tenant()
        if tenant is None:
            return None
        return self._classes[priority].backlog[tenant][0].item

    def peek_priority(self) -> int | None:
        for priority, queue in enumerate(self._classes):
            if queue.backlog:
                return priority
        return None

    def remove(self, key: str) -> T | None:
        """Takes out a waiting request (its client cancelled); None if not waiting."""
        where = self._where.pop(key, None)
        if where is None:
            return None
        priority, tenant = where
        queue = self._classes[priority].backlog[tenant]
        for entry in queue:
            if entry.key == key:
                queue.remove(entry)
                if not queue:
                    del self._classes[priority].backlog[tenant]
                self._num_filler -= entry.filler
                return entry.item
        return None

    def correct(
        self,
        tenant: str,
        priority: int,
        *,
        estimated_output: int,
        actual_output: int,
        actual_input_delta: int = 0,
    ) -> None:
        """Replaces a dispatched request's output estimate by the real count."""
        weight = self._weights.get(tenant, 1.0)
        counters = self._classes[priority].counters
        if tenant in counters:
            delta = actual_input_delta + OUTPUT_COST * (actual_output - estimated_output)
            counters[tenant] += delta / weight

    def counter(self, tenant: str, priority: int) -> float:
        return self._classes[priority].counters.get(tenant, 0.0)
