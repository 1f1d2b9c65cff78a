from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench.driver import RequestTrace, WaveResult
from bench.overhead import ArmWaves, summarize_run


def wave(ttft_s: float, num_tokens: int) -> WaveResult:
    first = 10.0 + ttft_s
    arrivals = [(first, 1), (first + 0.5, num_tokens - 1)]
    trace = RequestTrace(0, started=10.0, arrivals=arrivals, ended=11.0)
    return WaveResult(concurrency=1, wall_s=1.0, traces=[trace])


def run_args(concurrency: int) -> argparse.Namespace:
    """What ``summarize_run`` reads of the command line: one round at ``concurrency``."""
    return argparse.Namespace(
        concurrency=[concurrency], rounds=1, max_tokens=1000, min_requests=1,
        requests_per_lane=1, set=[], client_set=[], argv=[], pin_job=[],
    )  # fmt: skip


def run_summary(
    concurrency: int, bus_cpu: dict[str, float], direct_cpu: dict[str, float]
) -> dict[str, Any]:
    """``summarize_run`` of one wave per arm at ``concurrency``, with no spans or timings."""
    results = {
        ("direct", concurrency): ArmWaves([wave(0.016, 1000)], [direct_cpu]),
        ("tokenbus", concurrency): ArmWaves([wave(0.030, 1000)], [bus_cpu]),
    }
    load = {"at": "t", "load_1_5_15": [1.0, 1.0, 1.0]}
    return summarize_run(run_args(concurrency), results, {}, [], [0.1], load, load)


def test_summarize_run_splits_cpu_per_token_by_process_and_ttft_by_leg() -> None:
    args = run_args(1)
    bus_cpu = {
        "broker": 0.05,
        "stream_job": 0.01,
        "billing": 0.002,
        "client": 0.004,
        "worker_process": 0.03,
        "stream_job_system": 0.002,
        "client_system": 0.001,
        "worker_process_system": 0.0,
        "stream_job_runs": 2_000,
        "client_runs": 500,
        "stream_job_writes": 3_000,
        "broker_writes": 250,
    }
    results = {
        ("direct", 1): ArmWaves([wave(0.016, 1000)], [{"direct_frontend": 0.02}]),
        ("tokenbus", 1): ArmWaves([wave(0.030, 1000)], [bus_cpu]),
    }
    timings = [{"request_id": "r0", "queue_ms": 3.0, "ttft_ms": 22.0}]
    load = {"at": "t", "load_1_5_15": [1.0, 1.0, 1.0]}
    idle = {"stream_job": 0.06, "worker_loop": 0.01, "billing": 0.002}
    spans = [
        {"trace_id": "t0", "request_id": "r0", "name": "job.admit", "duration_us": 400},
        {"trace_id": "t0", "request_id": "", "name": "bus.dispatch", "duration_us": 4_500},
        {"trace_id": "t9", "request_id": "other", "name": "job.admit", "duration_us": 900},
    ]
    out = summarize_run(args, results, {"r0": (0, 1, 0)}, timings, [0.1], load, load, idle, spans)
    row = out["results"][0]
    # Idle cores over the bus wave's 1 s and 1,000 tokens: the job's 0.06 cores.
    assert row["us_cpu_per_token_idle_by_process"] == {
        "stream_job": 60.0,
        "worker_loop": 10.0,
        "billing": 2.0,
    }
    assert out["idle_cores_by_process_during_direct"]["stream_job"] == 0.06
    assert row["us_cpu_per_token_by_process"] == {
        "stream_job": 10.0,
        "worker_loop": 10.0,  # the worker process less the direct arm's front end
        "client": 4.0,
        "billing": 2.0,
        "broker": 50.0,
    }
    # Times on a CPU per token, for the processes whose count the run kept.
    assert row["runs_per_token_by_process"] == {"stream_job": 2.0, "client": 0.5}
    # Write system calls per token, likewise: what each process asked of the broker.
    assert row["writes_per_token_by_process"] == {"stream_job": 3.0, "broker": 0.25}
    # The kernel's share of each process's CPU, where it was measured.
    assert row["system_share_by_process"] == {
        "stream_job": 0.2,
        "worker_loop": 0.0,
        "client": 0.25,
        "billing": 0.0,
        "broker": 0.0,
    }
    assert row["pipeline_cpu_s_per_1k_tokens"] == pytest.approx(0.076)
    assert row["added_ttft_ms"]["p50"] == pytest.approx(14.0)
    legs = row["ttft_breakdown_ms"]
    assert legs["client_to_dispatched"]["p50"] == 3.0
    assert legs["dispatched_to_worker_first_token"]["p50"] == 19.0
    assert legs["worker_first_token_to_client"]["p50"] == pytest.approx(8.0)
    # The slowest requests, where each stood in its wave, and their legs (which add up).
    assert row["slowest_ttft_ms"] == [
        {
            "round": 0,
            "index": 0,
            "ttft": 30.0,
            "client_to_dispatched": 3.0,
            "dispatched_to_worker_first_token": 19.0,
            "worker_first_token_to_client": 8.0,
        }
    ]
    # Every request's legs and own spans (a hop span joined by its trace), for the shape
    # of the distribution that the percentiles summarize.
    legs_of_r0 = row["slowest_ttft_ms"][0]
    assert row["requests_ms"] == [
        {"request_id": "r0", **legs_of_r0, "spans": {"job.admit": 0.4, "bus.dispatch": 4.5}}
    ]


def test_the_overhead_table_shows_the_hop_floor_of_the_same_run() -> None:
    from bench import markdown

    cpu = {"broker": 0.0, "stream_job": 0.0, "billing": 0.0, "client": 0.0, "worker_process": 0.0}
    result = {
        **run_summary(1, cpu, {"direct_frontend": 0.0}),
        "machine": {"git": "abc1234"},
        "hop_floor": {
            "fetch_max_wait_ms": 20,
            "hop_ms": {"p50": 4.567, "p99": 12.0},
            "hop_in_process_ms": {"p50": 1.234, "p99": 5.0},
        },
    }
    text = markdown.overhead(result)
    assert text.endswith(
        "One hop through the same stack's broker after the waves (fetch_max_wait_ms 20): "
        "p50 4.57 ms, p99 12.00 ms; producer and consumer in lock-step in one process (the old "
        "measure), p50 1.23 ms."
    )
    del result["hop_floor"]["hop_in_process_ms"]  # a result written before the split
    assert markdown.overhead(result).endswith("p50 4.57 ms, p99 12.00 ms.")


def test_the_path_spans_count_the_measured_requests_of_each_concurrency_only() -> None:
    from bench.overhead import path_breakdown, spans_by_request

    request_ids = {"warm": (-1, 8, 0), "a": (0, 1, 0), "b": (1, 1, 0), "c": (0, 64, 0)}
    spans = [
        {"trace_id": "t0", "request_id": "warm", "name": "worker.intake", "duration_us": 1_000},
        {"trace_id": "t0", "request_id": "", "name": "bus.dispatch", "duration_us": 90_000},
        {"trace_id": "t1", "request_id": "", "name": "bus.dispatch", "duration_us": 2_000},
        {"trace_id": "t1", "request_id": "a", "name": "worker.intake", "duration_us": 1_500},
        {"trace_id": "t2", "request_id": "", "name": "bus.dispatch", "duration_us": 4_000},
        {"trace_id": "t2", "request_id": "b", "name": "job.admit", "duration_us": 500},
        {"trace_id": "t2", "request_id": "b", "name": "job.queue", "duration_us": 200},
        {"trace_id": "t1", "request_id": "a", "name": "job.admit", "duration_us": 400},
        {"trace_id": "t3", "request_id": "c", "name": "worker.prefill", "duration_us": 30_000},
        {"trace_id": "t4", "request_id": "", "name": "worker.emit", "duration_us": 7_000},
    ]
    at_1 = path_breakdown(spans_by_request(spans, request_ids, 1))
    # In path order, none missing; a hop span counts by its trace's request.
    assert list(at_1) == ["job.admit", "job.queue", "bus.dispatch", "worker.intake", "job"]
    assert at_1["bus.dispatch"]["n"] == 2
    assert at_1["bus.dispatch"]["max"] == 4.0  # not the warm-up's 90 ms
    assert at_1["worker.intake"]["p50"] == 1.5
    # A part counts the requests that have all its spans: "a" has no job.queue.
    assert at_1["job"] == {"n": 1, "p50": 0.7, "p90": 0.7, "p99": 0.7, "max": 0.7, "mean": 0.7}
    # The worker's own part needs both its spans: no request here has worker.emit.
    assert "worker_own" not in at_1
    emit = {"trace_id": "t1", "request_id": "", "name": "worker.emit", "duration_us": 700}
    assert (
        path_breakdown(spans_by_request([*spans, emit], request_ids, 1))["worker_own"]["p50"] == 2.2
    )
    assert path_breakdown(spans_by_request(spans, request_ids, 64)) == {
        "worker.prefill": {"n": 1, "p50": 30.0, "p90": 30.0, "p99": 30.0, "max": 30.0, "mean": 30.0}
    }


def test_a_run_without_tracing_reads_no_spans_and_waits_for_none() -> None:
    import time

    from bench.overhead import path_spans
    from tokenbus.config import Settings

    # No billing query server runs here: a query would fail, a wait would show.
    started = time.monotonic()
    assert path_spans(Settings(trace_sample_ratio=0.0), expected=10, timeout_s=5.0) == []
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("counter", "counts", "expected"),
    [
        # job, worker loop (its process's count), client, billing (not counted), broker
        ("runs", {"stream_job": 70, "worker_process": 193, "client": 36, "broker": 618},
         ["0.070", "0.193", "0.036", "-", "0.618"]),
        # job, worker loop (its process's count), client, billing, broker (not counted)
        ("writes", {"stream_job": 45, "worker_process": 120, "client": 8, "billing": 3},
         ["0.045", "0.120", "0.008", "0.003", "-"]),
    ],
)  # fmt: skip
def test_the_printed_split_shows_each_processs_counts_per_token(
    counter: str, counts: dict[str, int], expected: list[str]
) -> None:
    from rich.console import Console

    from bench.overhead import render

    cpu: dict[str, float] = {
        "broker": 0.01, "stream_job": 0.01, "billing": 0.01, "client": 0.01,
        "worker_process": 0.01, **{f"{part}_{counter}": n for part, n in counts.items()},
    }  # fmt: skip
    result = {**run_summary(64, cpu, {"direct_frontend": 0.0}), "machine": {"git": "abc1234"}}
    console = Console(record=True, width=200)
    render(result, console)
    [line] = [x for x in console.export_text().splitlines() if f"{counter} per token" in x]
    cells = [c.strip() for c in line.split("│") if c.strip()]
    assert cells == [f"64, {counter} per token", *expected]
