from __future__ import annotations

from bench.parked_fetch import sweep_rows


def test_a_sweep_row_is_the_answer_median_and_the_records_wait() -> None:
    # tansu at 20 ms: records produced at 1 and 2 ms both wait for the look at ~10.8.
    answers = {0: [0.8, 0.9, 0.7], 1: [10.8, 11.7, 10.9], 2: [10.8, 10.7, 10.9], 9: [15.7]}
    assert sweep_rows(answers) == [
        {"record_at_ms": 0, "answer_ms": 0.8, "waited_ms": 0.8},
        {"record_at_ms": 1, "answer_ms": 10.9, "waited_ms": 9.9},
        {"record_at_ms": 2, "answer_ms": 10.8, "waited_ms": 8.8},
        {"record_at_ms": 9, "answer_ms": 15.7, "waited_ms": 6.7},
    ]


def test_a_broker_that_answers_on_arrival_has_the_same_wait_at_every_step() -> None:
    answers = {x: [x + 1.25, x + 1.2, x + 1.3] for x in range(3)}
    assert [row["waited_ms"] for row in sweep_rows(answers)] == [1.25, 1.25, 1.25]
