"""The requests in flight, keyed ``(tenant, request id)``, with the counts the dispatcher
reads on its hot path kept as entries come and go.

# put / delete --> the entry's facets (model, class 2?, a batch's line?) --> counts

The seat reserve's batch cap (class 2 in flight for a model, beside the rest), the
overload tier (a batch's lines in flight) and every load report (in flight by model)
each walked every request in flight, on every class 2 forward, near a tier threshold,
and every second: O(requests in flight), where one job instance may hold thousands.
Here each entry's facets are read once, when it is put, and kept beside it, so removing
it takes back exactly what putting it added. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import NamedTuple, TypeVar

V = TypeVar("V")
Key = tuple[str, str]


class Facets(NamedTuple):
    """What is counted of a request in flight."""

    model: str
    batch_class: bool
    """Of class 2 (``seats.BATCH_CLASS``)."""
    batch_line: bool
    """A line of a batch job (its ``batch_id`` set)."""


class ModelCounts(NamedTuple):
    num: int = 0
    num_batch_class: int = 0
    num_batch_lines: int = 0


class InFlightTable(MutableMapping[Key, V]):
    """A dict of the requests in flight that keeps, per model, how many there are, how
    many of class 2 and how many are a batch's lines; ``facets`` reads those of an entry
    when it is put (an entry's request is never swapped while it is held)."""

    def __init__(self, facets: Callable[[V], Facets]) -> None:
        self._facets = facets
        self._entries: dict[Key, tuple[V, Facets]] = {}
        self._by_model: dict[str, list[int]] = {}
        self._num_batch_lines = 0

    def __getitem__(self, key: Key) -> V:
        return self._entries[key][0]

    def get(self, key: Key, default: V | None = None) -> V | None:  # type: ignore[override]
        held = self._entries.get(key)
        return default if held is None else held[0]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def __setitem__(self, key: Key, value: V) -> None:
        if key in self._entries:
            self._count(self._entries[key][1], -1)
        facets = self._facets(value)
        self._entries[key] = (value, facets)
        self._count(facets, 1)

    def __delitem__(self, key: Key) -> None:
        _, facets = self._entries.pop(key)
        self._count(facets, -1)

    def _count(self, facets: Facets, step: int) -> None:
        counts = self._by_model.get(facets.model)
        if counts is None:
            counts = self._by_model[facets.model] = [0, 0, 0]
        counts[0] += step
        counts[1] += step * facets.batch_class
        counts[2] += step * facets.batch_line
        self._num_batch_lines += step * facets.batch_line
        if counts[0] == 0:
            del self._by_model[facets.model]

    def of_model(self, model: str) -> ModelCounts:
        """The requests in flight for ``model``: all, of class 2, a batch's lines."""
        counts = self._by_model.get(model)
        return ModelCounts(*counts) if counts is not None else ModelCounts()

    def models(self) -> list[str]:
        """The models with a request in flight."""
        return list(self._by_model)

    @property
    def num_batch_lines(self) -> int:
        """A batch's lines in flight, of every model."""
        return self._num_batch_lines
