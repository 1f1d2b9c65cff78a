from __future__ import annotations

import pytest

from bridge.byte_budget import ByteBudget


def test_files_are_let_in_while_their_bytes_fit() -> None:
    budget = ByteBudget(1000)
    assert budget.try_take(600)
    assert budget.try_take(400)
    assert not budget.try_take(1)
    assert budget.num_taken == 1000
    budget.give_back(600)
    assert budget.try_take(500)
    assert not budget.try_take(101)
    assert budget.num_taken == 900


def test_a_file_larger_than_the_limit_is_let_in_alone() -> None:
    budget = ByteBudget(1000)
    assert budget.try_take(10)
    assert not budget.try_take(5000)  # not beside another
    budget.give_back(10)
    assert budget.try_take(5000)  # alone, or never
    assert not budget.try_take(1)
    budget.give_back(5000)
    assert budget.num_taken == 0


def test_an_empty_file_always_fits() -> None:
    budget = ByteBudget(10)
    assert budget.try_take(10)
    assert budget.try_take(0)


def test_zero_is_no_limit() -> None:
    budget = ByteBudget(0)
    assert all(budget.try_take(1 << 30) for _ in range(8))
    assert budget.num_taken == 8 << 30


def test_bytes_not_taken_cannot_be_given_back() -> None:
    budget = ByteBudget(100)
    assert budget.try_take(10)
    with pytest.raises(ValueError):
        budget.give_back(11)
    assert budget.num_taken == 10
    with pytest.raises(ValueError):
        ByteBudget(-1)
