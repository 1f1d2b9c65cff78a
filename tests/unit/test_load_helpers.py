"""The pure helpers of the chaos matrix (tests/load): which streams a fault would cut,
a quota's admitted tokens per minute, and the cores a process tree used."""

from __future__ import annotations

import os

import pytest

from schemas import FinishReason, TokenChunk
from tests.load.chaos import admitted_per_minute
from tests.load.cpu import cores, subtree, tree_cpu_s
from tests.load.steady import num_mid_stream


def _chunks(request_id: str, tokens: list[int], last: bool = False) -> list[TokenChunk]:
    chunks = [
        TokenChunk(request_id=request_id, tenant_id="t", seq=n, num_tokens=k)
        for n, k in enumerate(tokens)
    ]
    if last:
        chunks[-1] = chunks[-1].model_copy(update={"finish_reason": FinishReason.LENGTH})
    return chunks


def test_mid_stream_counts_begun_unfinished_streams() -> None:
    outcomes = {
        "waiting": [],
        "early": _chunks("early", [1, 1, 1]),
        "late": _chunks("late", [1] * 30),
        "done": _chunks("done", [1, 1], last=True),
    }
    assert num_mid_stream(outcomes) == 2
    assert num_mid_stream(outcomes, at_most_tokens=24) == 1
    assert num_mid_stream(outcomes, request_ids={"late", "done"}) == 1
    assert num_mid_stream(outcomes, request_ids={"late"}, at_most_tokens=24) == 0
    assert num_mid_stream(outcomes, request_ids=set()) == 0


def test_admitted_per_minute_counts_whole_minutes_from_the_start() -> None:
    # One 24-token request every 0.6 s for 150 s from t=1000: 100 a minute.
    admitted = [(1000 + 0.6 * k, 24) for k in range(250)]
    assert admitted_per_minute(admitted, 1000, 1150) == [2400, 2400]
    # A minute ends 59.9 s after it starts: one that ends after ``until`` is not whole.
    assert admitted_per_minute(admitted, 1000, 1059.8) == []
    assert admitted_per_minute(admitted, 1000, 1059.9) == [2400]
    # Nothing admitted before the first request.
    assert admitted_per_minute(admitted, 900, 960) == [0]


def test_admitted_per_minute_leaves_out_the_minute_edge() -> None:
    admitted = [(0.0, 24), (59.95, 24), (60.0, 24)]
    assert admitted_per_minute(admitted, 0.0, 120.0) == [24, 24]


def test_cores_is_cpu_seconds_over_time_between_the_outer_snapshots_in_the_span() -> None:
    snapshots = [
        (0.0, {"job": 0.0, "broker": 5.0}),
        (10.0, {"job": 4.0, "broker": 6.0}),
        (20.0, {"job": 9.0, "broker": 7.0}),
        (30.0, {"job": 10.0, "broker": 1.0}),  # the broker restarted: its count fell
    ]
    assert cores(snapshots, 0, 20) == pytest.approx({"job": 0.45, "broker": 0.1})
    assert cores(snapshots, 5, 25) == pytest.approx({"job": 0.5, "broker": 0.1})
    assert cores(snapshots, 10, 30) == pytest.approx({"job": 0.3})
    assert cores(snapshots, 5, 15) == {}  # one snapshot: no span to divide by


def test_subtree_stops_at_other_roots() -> None:
    parent = {1: 0, 2: 1, 3: 2, 4: 1, 5: 4, 6: 5}
    assert sorted(subtree(parent, 1)) == [1, 2, 3, 4, 5, 6]
    assert sorted(subtree(parent, 1, stop={4})) == [1, 2, 3]
    assert sorted(subtree(parent, 4)) == [4, 5, 6]
    assert subtree(parent, 9) == []


def test_tree_cpu_s_reads_this_process() -> None:
    for _ in range(200_000):
        pass
    taken = tree_cpu_s({"me": os.getpid()})
    assert taken["me"] > 0
