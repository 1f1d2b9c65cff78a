from __future__ import annotations

import argparse

import pytest

from bench.common import at_least_one
from bench.parked_fetch import sweep_rows


def test_a_sweep_row_is_the_answer_median_and_the_records_wait() -> None:
    # tansu at 20 ms: records produced at 1 and 2 ms both wait for the look at ~10.8; one
    # produced at 21 ms came after the fetch had ended.
    answers: dict[int, list[float | None]] = {
        0: [0.8, 0.9, 0.7],
        1: [10.8, 11.7, 10.9],
        2: [10.8, 10.7, 10.9],
        21: [None, None, 21.5],
    }
    assert sweep_rows(answers) == [
        {"record_at_ms": 0, "answer_ms": 0.8, "waited_ms": 0.8, "ended_without_it": 0},
        {"record_at_ms": 1, "answer_ms": 10.9, "waited_ms": 9.9, "ended_without_it": 0},
        {"record_at_ms": 2, "answer_ms": 10.8, "waited_ms": 8.8, "ended_without_it": 0},
        {"record_at_ms": 21, "answer_ms": 21.5, "waited_ms": 0.5, "ended_without_it": 2},
    ]
    none_brought = sweep_rows({22: [None]})[0]
    assert none_brought["answer_ms"] is None and none_brought["ended_without_it"] == 1


def test_a_broker_that_answers_on_arrival_has_the_same_wait_at_every_step() -> None:
    answers: dict[int, list[float | None]] = {x: [x + 1.25, x + 1.2, x + 1.3] for x in range(3)}
    assert [row["waited_ms"] for row in sweep_rows(answers)] == [1.25, 1.25, 1.25]


def test_the_wait_and_the_repeats_are_whole_numbers_of_one_or_more() -> None:
    assert at_least_one("20") == 20
    for text in ("0", "-5", "2.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            at_least_one(text)
