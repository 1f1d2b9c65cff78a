"""stream_jobs.intake_watch: a request partition the job stopped reading while behind is
named after stall_s, once per stall_s, and forgotten once it moves or catches up."""

from __future__ import annotations

from stream_jobs.intake_watch import IntakeWatch, PartitionIntake


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def intake(read: int | None, highwater: int | None, position: int | None = None) -> PartitionIntake:
    return PartitionIntake("tokenbus.requests.p1", 3, read, position, highwater)


def test_a_partition_behind_that_stands_still_is_named_once_per_stall() -> None:
    clock = Clock()
    watch = IntakeWatch(stall_s=15, clock=clock)
    assert watch.observe([intake(38, 140)]) == []
    clock.now += 14
    assert watch.observe([intake(38, 140)]) == []
    clock.now += 1
    assert watch.observe([intake(38, 140)]) == [intake(38, 140)]
    clock.now += 5
    assert watch.observe([intake(38, 140)]) == []  # said already
    clock.now += 10
    assert watch.observe([intake(38, 140)]) == [intake(38, 140)]


def test_moving_or_caught_up_is_not_stuck() -> None:
    clock = Clock()
    watch = IntakeWatch(stall_s=15, clock=clock)
    for read in range(10):
        assert watch.observe([intake(read, 140)]) == []  # reading, slowly
        clock.now += 10
    for _ in range(5):
        assert watch.observe([intake(139, 140)]) == []  # took the last record
        assert watch.observe([intake(None, None, position=0)]) == []  # nothing fetched yet
        clock.now += 10


def test_before_the_stream_reads_the_position_counts() -> None:
    clock = Clock()
    watch = IntakeWatch(stall_s=15, clock=clock)
    watch.observe([intake(None, 140, position=20)])
    clock.now += 15
    assert watch.observe([intake(None, 140, position=20)]) == [intake(None, 140, position=20)]


def test_the_description_says_which_layer_holds_the_records() -> None:
    held = PartitionIntake("tokenbus.requests.p1", 3, 38, 39, 140, held=True, paused=True)
    assert held.describe() == (
        "tokenbus.requests.p1[3] read 38 position 39 high-water 140 held paused"
    )


def test_the_job_reads_where_faust_and_aiokafka_stand() -> None:
    from types import SimpleNamespace
    from typing import Any

    from aiokafka import TopicPartition

    from stream_jobs.app import request_intakes

    taken, held, paused, other = (
        TopicPartition("tokenbus.requests.p1", 0),
        TopicPartition("tokenbus.requests.p1", 3),
        TopicPartition("tokenbus.requests.p2", 1),
        TopicPartition("tokenbus-dispatch-request-ledger-changelog", 3),
    )
    states = {
        taken: SimpleNamespace(has_valid_position=True, position=90, highwater=90),
        held: SimpleNamespace(has_valid_position=True, position=39, highwater=140),
        paused: SimpleNamespace(has_valid_position=False, position=None, highwater=None),
        other: SimpleNamespace(has_valid_position=True, position=7, highwater=9),
    }
    assignment = SimpleNamespace(tps=set(states), state_value=states.__getitem__)
    inner = SimpleNamespace(
        _subscription=SimpleNamespace(subscription=SimpleNamespace(assignment=assignment)),
        _fetcher=SimpleNamespace(_records={held: object(), other: object()}),
    )
    consumer = SimpleNamespace(
        _thread=SimpleNamespace(_consumer=inner),
        _active_partitions={taken, held},
        _paused_partitions={paused},
        _read_offset={taken: 89, held: 38},
    )
    app: Any = SimpleNamespace(consumer=consumer)
    topics = {"tokenbus.requests.p1", "tokenbus.requests.p2"}
    assert sorted(request_intakes(app, topics), key=lambda i: (i.topic, i.partition)) == [
        PartitionIntake("tokenbus.requests.p1", 0, 89, 90, 90),
        PartitionIntake("tokenbus.requests.p1", 3, 38, 39, 140, held=True),
        PartitionIntake("tokenbus.requests.p2", 1, None, None, None, paused=True),
    ]
    assert request_intakes(SimpleNamespace(consumer=None), topics) == []  # type: ignore[arg-type]
