from __future__ import annotations

import asyncio
import os
import time

from bench.batch_interference import (
    PERF_TO_EPOCH,
    MetricsScraper,
    PhaseCpu,
    Sample,
    UsageFollower,
    cpu_per_token,
    drain,
    first_below,
    goals,
    learner_steps,
    parse_metrics,
    per_second,
    pooled,
    recovery_s,
    report_summary,
    timeline_summary,
    trace_rate,
    ttft_sequence,
    wave_size,
    wave_summary,
    window_rate,
    window_tokens,
)
from bench.driver import RequestTrace, WaveResult
from tokenbus.config import Settings

METRICS = """\
# HELP tokenbus_batch_pacer_limit Lines the runner's batches may keep in flight together
# TYPE tokenbus_batch_pacer_limit gauge
tokenbus_batch_pacer_limit 32.0
tokenbus_batch_lines{batch="b1",state="completed",tenant="t"} 100.0
tokenbus_batch_lines{batch="b1",state="in_flight",tenant="t"} 20.0
tokenbus_batch_lines{batch="b2",state="in_flight",tenant="t"} 5.0
tokenbus_batch_tokens{batch="b1",kind="completion",tenant="t"} 1600.0
tokenbus_batch_tokens{batch="b1",kind="prompt",tenant="t"} 15000.0
"""


def test_parse_metrics_reads_the_limit_and_sums_lines_in_flight_over_batches() -> None:
    assert parse_metrics(METRICS) == {"limit": 32.0, "in_flight": 25.0, "completion_tokens": 1600.0}
    assert parse_metrics("# nothing running\n") == {}


def test_rates_count_whole_seconds_and_empty_seconds_as_zero() -> None:
    buckets = per_second([(100.2, 16), (100.9, 16), (101.5, 16), (103.0, 16)])
    assert buckets == {100: 32, 101: 16, 103: 16}
    assert window_rate(buckets, 100, 104) == 64 / 4
    assert window_rate(buckets, 100, 100) == 0.0
    assert window_tokens(buckets, 100.5, 103.9) == 48  # the seconds 100, 101 and 102


def test_cpu_per_token_is_per_process_and_of_them_all() -> None:
    assert cpu_per_token({"broker": 0.2, "worker-0": 0.6}, 1000) == {
        "broker": 200.0,
        "worker-0": 600.0,
        "all": 800.0,
    }
    assert cpu_per_token({"broker": 0.2}, 0) == {}  # no batch token finished in the phase


def test_trace_rate_takes_the_deltas_inside_the_window_only() -> None:
    trace = RequestTrace(0, started=0.0, arrivals=[(0.5, 4), (1.5, 4), (2.5, 4)], ended=3.0)
    assert trace_rate([trace, trace], 1.0, 3.0) == 16 / 2.0
    assert trace_rate([trace], 2.0, 2.0) == 0.0


def test_recovery_is_the_first_second_whose_three_second_mean_reaches_the_target() -> None:
    # Stopped at 10.4; slow until 14, full speed from 14 on.
    buckets = {s: 100 for s in range(0, 10)} | {s: 20 for s in range(10, 14)}
    buckets |= {s: 100 for s in range(14, 20)}
    assert recovery_s(buckets, 10.4, target=80.0) == 3.6  # the window 14..16
    assert recovery_s({10: 10, 11: 10, 12: 10}, 10.0, target=80.0) is None
    assert recovery_s({}, 10.0, target=1.0) is None


def test_timeline_summary_and_first_backoff_per_phase() -> None:
    samples = [Sample(float(t), limit, in_flight) for t, limit, in_flight in (
        (0, 64, 60), (1, 64, 64), (2, 32, 30), (3, 16, 16), (4, 17, 16), (5, None, None),
    )]  # fmt: skip
    summary = timeline_summary(samples, {"C": (0.0, 2.0), "D": (2.0, 6.0), "E": (6.0, 9.0)})
    assert summary["C"]["limit"] == {"min": 64, "median": 64.0, "max": 64}
    assert summary["D"]["in_flight"] == {"min": 16, "median": 16.0, "max": 30}
    assert summary["D"]["samples"] == 4
    assert summary["E"] == {"seconds": 3.0, "samples": 0, "limit": None, "in_flight": None}
    assert first_below(samples, 1.0, 64) == 1.0
    assert first_below(samples, 0.0, 8) is None


def test_goals_put_each_figure_beside_its_goal() -> None:
    rows = goals(
        {"alone": {1: 100.0, 16: 200.0}, "with_batch": {1: 140.0, 16: 400.0}},
        full_rates={"before": 1000.0},
        batch_rate=850.0,
        recovered_s=None,
    )
    assert [(r["value"], r["met"]) for r in rows] == [
        (1.4, True),
        (2.0, False),
        (0.85, True),
        (None, False),
    ]


def test_report_summary_reads_the_job_reports_inside_the_window() -> None:
    def report(at: float, waiting: list[int], ttft: float | None) -> dict[str, object]:
        return {"at": at, "waiting_by_class": waiting, "queue_p99": 1.0, "ttft_p99": ttft}

    reports = [
        report(1.0, [0, 0, 9], 100.0),
        report(2.0, [0, 2, 0], None),
        report(5.0, [1, 0, 0], 9.0),
    ]
    summary = report_summary(reports, 1.0, 5.0)
    assert summary["reports"] == 2
    assert summary["with_interactive_waiting"] == 1
    assert summary["ttft_p99_ms"]["n"] == 1 and summary["ttft_p99_ms"]["max"] == 100.0
    assert summary["queue_p99_ms"]["n"] == 2


def test_ttft_sequence_is_in_start_order_from_the_first_start() -> None:
    late = RequestTrace(index=0, started=12.0, arrivals=[(12.05, 1)])
    early = RequestTrace(index=1, started=10.0, arrivals=[(10.3, 1)])
    failed = RequestTrace(index=2, started=11.0, error="boom")
    wave = WaveResult(concurrency=1, wall_s=2.1, traces=[late, early, failed])
    assert ttft_sequence(wave) == [(0.0, 300.0), (1000.0, None), (2000.0, 50.0)]
    assert ttft_sequence(WaveResult(concurrency=1, wall_s=0.0, traces=[])) == []


def test_goals_judge_the_pooled_baseline_and_show_each_part_beside_it() -> None:
    rows = goals(
        {
            "alone": {1: 100.0},
            "alone_before": {1: 80.0},
            "alone_after": {1: 120.0},
            "with_batch": {1: 140.0},
        },
        full_rates={"before": 1000.0},
        batch_rate=850.0,
        recovered_s=2.0,
    )
    assert rows[0]["value"] == 1.4 and rows[0]["met"] is True
    assert rows[0]["against_each_part"] == {"before": 1.75, "after": 1.167}


def test_pooled_keeps_every_request_of_both_parts() -> None:
    before = WaveResult(1, 2.0, [RequestTrace(index=i, started=0.0) for i in range(3)])
    after = WaveResult(1, 3.0, [RequestTrace(index=i, started=9.0) for i in range(2)])
    both = pooled(before, after)
    assert (both.concurrency, both.wall_s, len(both.traces)) == (1, 5.0, 5)
    assert both.traces[:3] == before.traces and both.traces[3:] == after.traces


def test_drain_waits_for_no_line_in_flight_and_a_quiet_spell() -> None:
    follower = UsageFollower(Settings())
    scraper = MetricsScraper("http://unused")

    async def run() -> tuple[bool, float]:
        now = time.time()
        follower.events.append((now, 16))  # a line just ended
        scraper.samples.append(Sample(now + 1.0, 64.0, 3.0))  # three still running
        done = [False]
        task = asyncio.create_task(
            drain(follower, scraper, lambda: done[0], quiet_s=1.0, timeout_s=5.0)
        )
        await asyncio.sleep(0.7)
        assert not task.done()
        scraper.samples.append(Sample(time.time() + 0.1, 64.0, 0.0))
        await asyncio.sleep(1.2)
        assert not task.done()  # no line in flight, quiet, but its files not yet written
        done[0] = True
        started = time.monotonic()
        return await task, time.monotonic() - started

    drained, waited = asyncio.run(run())
    assert drained is True and waited < 1.0


def test_drain_gives_up_at_its_timeout() -> None:
    follower = UsageFollower(Settings())
    scraper = MetricsScraper("http://unused")
    scraper.samples.append(Sample(time.time() + 60.0, 64.0, 5.0))
    assert asyncio.run(drain(follower, scraper, lambda: True, quiet_s=0.1, timeout_s=0.6)) is False


def test_phase_cpu_names_each_phase_at_its_end_in_cores() -> None:
    cpu = PhaseCpu({"me": [os.getpid()], "gone": [2**22 + 7]})
    cpu.mark("start")  # only starts the clock
    spin_until = time.monotonic() + 0.3
    while time.monotonic() < spin_until:
        pass
    cpu.mark("busy")
    time.sleep(0.3)
    cpu.mark("idle")
    cores = cpu.cores()
    assert list(cores) == ["busy", "idle"]
    assert cores["busy"]["me"] > 0.3 and cores["idle"]["me"] < cores["busy"]["me"]
    assert cores["busy"]["gone"] == 0.0


def test_the_batchs_share_is_of_class_1s_mean_rate_before_and_after() -> None:
    rows = goals(
        {"alone": {}, "with_batch": {}},
        full_rates={"before": 1200.0, "after": 800.0},
        batch_rate=850.0,
        recovered_s=2.0,
    )
    assert rows[0]["value"] == 0.85 and rows[0]["met"] is True
    assert rows[0]["against_each_part"] == {"before": 0.708, "after": 1.062}


def test_a_wave_holds_as_many_bursts_as_a_lane_has_requests() -> None:
    assert wave_size(1, 128) == 128
    assert wave_size(16, 128) == 2048


def test_learner_steps_are_read_from_the_workers_log_lines_with_their_times() -> None:
    lines = [
        "2026-12-03 14:00:00,250 INFO workers.worker: took acme/r1",
        "2026-12-03 14:00:01,500 INFO workers.batch_gate: batch seats: probe at TTFT 40 ms"
        " (baseline 35 ms) beside 0 lines; now 1 seats, next probe after 32 requests",
        "2026-12-03 14:00:02,000 INFO workers.batch_gate: batch seats: probe failed at TTFT"
        " 120 ms (baseline 35 ms) beside 1 lines; now 0 seats, next probe after 64 requests",
    ]
    (probe, failed) = learner_steps(lines)
    assert probe[1] == "probe" and failed[1] == "probe failed"
    assert failed[0] - probe[0] == 0.5


def test_a_waves_summary_places_the_learners_steps_inside_it_from_its_first_start() -> None:
    traces = [
        RequestTrace(index=i, started=100.0 + i, arrivals=[(100.05 + i, 1)]) for i in range(3)
    ]
    origin = 100.0 + PERF_TO_EPOCH
    steps = [(origin - 1.0, "probe"), (origin + 1.25, "probe failed"), (origin + 9.0, "probe")]
    summary = wave_summary(WaveResult(concurrency=1, wall_s=3.0, traces=traces), steps)
    assert summary["learner"] == [(1250.0, "probe failed")]  # the others are outside it
    assert summary["first_ttft_ms"] == 50.0
