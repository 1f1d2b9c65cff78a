"""The in-flight table's counts against a fresh count of what it holds."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from stream_jobs.in_flight import Facets, InFlightTable, ModelCounts


@dataclass(frozen=True)
class Flight:
    model: str
    priority: int
    batch_id: str | None = None


def facets(flight: Flight) -> Facets:
    return Facets(flight.model, flight.priority == 2, flight.batch_id is not None)


def fresh(held: dict[tuple[str, str], Flight], model: str) -> ModelCounts:
    of_model = [f for f in held.values() if f.model == model]
    return ModelCounts(
        len(of_model),
        sum(f.priority == 2 for f in of_model),
        sum(f.batch_id is not None for f in of_model),
    )


def test_counts_follow_puts_replacements_and_removals() -> None:
    table: InFlightTable[Flight] = InFlightTable(facets)
    table[("acme", "r1")] = Flight("m", 2, "b1")
    table[("acme", "r2")] = Flight("m", 1)
    table[("beta", "r1")] = Flight("n", 0)
    assert table.of_model("m") == ModelCounts(2, 1, 1)
    assert table.of_model("n") == ModelCounts(1, 0, 0)
    assert table.num_batch_lines == 1
    table[("acme", "r1")] = Flight("n", 1)  # replaced: the old entry's counts go
    assert table.of_model("m") == ModelCounts(1, 0, 0)
    assert table.of_model("n") == ModelCounts(2, 0, 0)
    assert table.num_batch_lines == 0
    del table[("acme", "r2")]
    assert table.pop(("beta", "r1")) == Flight("n", 0)
    assert table.pop(("beta", "r1"), None) is None
    assert table.models() == ["n"]
    assert table.of_model("m") == ModelCounts()
    assert len(table) == 1 and ("acme", "r1") in table and table.get(("x", "y")) is None


def test_a_missing_key_raises_as_a_dict_does() -> None:
    table: InFlightTable[Flight] = InFlightTable(facets)
    with pytest.raises(KeyError):
        del table[("acme", "nope")]
    with pytest.raises(KeyError):
        table[("acme", "nope")]


def test_randomised_against_a_fresh_count() -> None:
    rng = random.Random(17)
    table: InFlightTable[Flight] = InFlightTable(facets)
    held: dict[tuple[str, str], Flight] = {}
    models = ["m", "n", "o"]
    for _ in range(5_000):
        key = (rng.choice(["acme", "beta"]), f"r{rng.randrange(40)}")
        action = rng.random()
        if action < 0.55:
            flight = Flight(rng.choice(models), rng.randrange(3), rng.choice([None, "b"]))
            table[key] = held[key] = flight
        elif action < 0.8:
            assert table.pop(key, None) == held.pop(key, None)
        elif key in held:
            del table[key]
            del held[key]
        for model in models:
            assert table.of_model(model) == fresh(held, model)
        assert table.num_batch_lines == sum(f.batch_id is not None for f in held.values())
        assert sorted(table.models()) == sorted({f.model for f in held.values()})
        assert dict(table.items()) == held
