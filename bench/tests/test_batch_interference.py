from __future__ import annotations

from bench.batch_interference import (
    Sample,
    first_below,
    goals,
    parse_metrics,
    per_second,
    recovery_s,
    report_summary,
    timeline_summary,
    trace_rate,
    window_rate,
)
from bench.driver import RequestTrace

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
        full_rate=1000.0,
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
