from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import summary


def admission(
    at: str, per_core: float, *, commit: str = "c1", dirty: bool = False, load: float = 1.0
) -> dict[str, Any]:
    return {
        "benchmark": "admission",
        "machine": {"commit": commit, "dirty": dirty},
        "load_start": {"at": at, "load_1_5_15": [load, 0.0, 0.0]},
        "results": [
            {
                "requests_per_core_s": per_core,
                "cpu_s": {"stream_job": 2.0, "broker": 1.0},
                "num_forwarded": 4000,
                "broker_cpu_ms_per_1k": 250.0,
                "request_bytes": 900,
                "header_bytes": 300,
            }
        ],
    }


def overhead(at: str) -> dict[str, Any]:
    def row(concurrency: int) -> dict[str, Any]:
        return {
            "concurrency": concurrency,
            "added_ttft_ms": {"p50": 12.0, "p90": 20.0, "p99": 30.0},
            "direct": {"ttft_ms": {"p50": 16.0, "p90": 30.0, "p99": 400.0}},
            "tokenbus": {"ttft_ms": {"p50": 28.0, "p90": 36.0, "p99": 46.0}},
            "pipeline_cpu_s_per_1k_tokens": 0.12,
            "pipeline_cpu_s_per_1k_tokens_by_part": {
                "broker": 0.1,
                "stream_job": 0.004,
                "billing": 0.002,
                "client": 0.008,
                "worker_loop": 0.006,
            },
            "us_cpu_per_token_idle_by_process": {
                "stream_job": 1.0,
                "worker_loop": 2.0,
                "billing": 0.5,
                "broker": 30.0,
            },
            "ttft_breakdown_ms": {
                "client_to_dispatched": {"p50": 3.0, "p99": 9.0},
                "dispatched_to_worker_first_token": {"p50": 20.0, "p99": 30.0},
                "worker_first_token_to_client": {"p50": 4.0, "p99": 8.0},
            },
        }

    return {
        "benchmark": "overhead",
        "machine": {"commit": "c9", "dirty": False},
        "load_start": {"at": at, "load_1_5_15": [2.0, 0.0, 0.0]},
        "hop_floor": {"hop_ms": {"p50": 1.5, "p99": 3.0}},
        "results": [row(1), row(64)],
    }


def test_select_runs_keeps_the_newest_clean_runs_of_the_newest_commit() -> None:
    runs = [
        admission("2026-12-01T10:00:00", 700, commit="old"),
        admission("2026-12-01T11:00:00", 800, commit="new"),
        admission("2026-12-01T12:00:00", 900, commit="new"),
        admission("2026-12-01T13:00:00", 5000, commit="new", dirty=True),
        admission("2026-12-01T09:00:00", 600, commit="new"),
    ]
    chosen = summary.select_runs(runs, max_runs=2)
    assert [r["results"][0]["requests_per_core_s"] for r in chosen] == [900, 800]


def test_results_without_a_known_commit_are_not_clean() -> None:
    result = admission("2026-12-01T10:00:00", 700)
    del result["machine"]["dirty"]
    assert not summary.is_clean(result)
    assert summary.select_runs([result], 3) == []


def test_figure_is_the_median_with_its_spread_load_and_commit() -> None:
    runs = [
        admission("2026-12-01T11:00:00", 800, load=2.0),
        admission("2026-12-01T12:00:00", 1200, load=4.0),
        admission("2026-12-01T10:00:00", 1000, load=3.0),
    ]
    built = summary.build_summary({"admission": runs}, generated_at="now")
    figure = built["figures"]["admission.requests_per_job_core_s"]
    assert (figure["median"], figure["min"], figure["max"]) == (1000, 800, 1200)
    assert figure["num_runs"] == 3
    assert figure["load_1min"] == {"median": 3.0, "min": 2.0, "max": 4.0}
    assert figure["commit"] == "c1"
    assert figure["date"] == "2026-12-01T12:00:00"
    assert built["figures"]["admission.job_us_per_request"]["median"] == 500.0
    assert built["figures"]["admission.request_record_bytes"]["median"] == 1200.0


def test_added_ttft_is_the_bus_arms_percentile_less_the_direct_arms_median() -> None:
    """A direct arm whose tail stalled (p99 400 ms) does not make the bus's p99 look free."""
    run = overhead("x")
    for row in run["results"]:
        row["tokenbus"]["ttft_ms"]["p99"] = 120.0  # stored p99 - p99 would be -280 ms
    built = summary.build_summary({"overhead": [run]})
    assert built["figures"]["ttft.added_p99_ms"]["median"] == 104.0
    assert built["figures"]["ttft.added_p50_ms"]["median"] == 12.0
    by_key = {g["key"]: g for g in built["goals"]}
    assert by_key["ttft_p99"]["verdict"] == "not met"


def test_the_p99_goal_shows_its_sample_count_and_the_worst_request_beside_it() -> None:
    """Over fewer than 100 requests a nearest-rank p99 is the worst one: the count and
    the max are shown, so a reader can tell the two apart."""
    run = overhead("x")
    for row in run["results"]:
        row["tokenbus"]["ttft_ms"].update(p99=50.0, max=90.0)
        row["tokenbus"]["num_requests"] = 192
    built = summary.build_summary({"overhead": [run]})
    assert built["figures"]["ttft.added_max_ms"]["median"] == 74.0  # 90 - the direct p50
    assert built["figures"]["ttft.num_requests"]["median"] == 192.0
    beside = next(g for g in built["goals"] if g["key"] == "ttft_p99")["beside"]
    assert beside[:2] == ["ttft.num_requests", "ttft.added_max_ms"]


def test_the_c64_goals_show_the_seat_reserve_and_throughput_their_runs_had() -> None:
    old, new = overhead("2026-12-01T10:00:00"), overhead("2026-12-01T11:00:00")
    new["parameters"] = {"vip_reserve": 0.0}
    for run, ratio in ((old, 0.5), (new, 0.8)):
        run["results"][1]["ratios"] = {"throughput": ratio}
    built = summary.build_summary({"overhead": [old, new]})
    reserve, ratio = built["figures"]["e2e.vip_reserve"], built["figures"]["e2e.throughput_ratio"]
    # A run written before the field ran on the default (0.3).
    assert (reserve["min"], reserve["max"]) == (0.0, 0.3)
    assert (ratio["min"], ratio["max"]) == (0.5, 0.8)
    by_key = {g["key"]: g for g in built["goals"]}
    assert {"e2e.vip_reserve", "e2e.throughput_ratio"} <= set(by_key["e2e_tokenbus"]["beside"])


def test_goal_verdicts() -> None:
    runs = [admission("2026-12-01T10:00:00", 6000)]
    built = summary.build_summary({"admission": runs, "overhead": [overhead("x")]})
    by_key = {g["key"]: g for g in built["goals"]}
    assert by_key["admission"]["verdict"] == "met"
    assert by_key["admission"]["num_runs"] == 1
    assert by_key["admission"]["beside"] == ["admission.job_us_per_request"]
    # 4 + 6 + 8 + 2 µs per token: met; 0.12 s per 1k tokens with the broker: not met.
    assert built["figures"]["e2e.tokenbus_us_per_token"]["median"] == 20.0
    assert by_key["e2e_tokenbus"]["verdict"] == "met"
    assert built["figures"]["e2e.tokenbus_idle_us_per_token"]["median"] == 3.5
    assert "e2e.tokenbus_idle_us_per_token" in by_key["e2e_tokenbus"]["beside"]
    assert by_key["e2e_pipeline"]["verdict"] == "not met"
    assert by_key["ttft_p50"]["verdict"] == "not met"
    assert by_key["ttft_p99"]["verdict"] == "met"
    assert "ttft.hop_floor_p50_ms" in by_key["ttft_p50"]["beside"]
    assert built["figures"]["ttft.hop_floor_p50_ms"]["median"] == 1.5
    assert by_key["billing"]["verdict"] == "not measured"
    assert by_key["billing"]["commit"] is None


def billing(at: str, per_core: float, kernel: tuple[float, float] | None = None) -> dict[str, Any]:
    """A billing run; ``kernel``: its µs of kernel CPU and minor faults per event."""
    row: dict[str, Any] = {"events_per_core_s": per_core}
    if kernel is not None:
        row["us_system_per_event"], row["minor_faults_per_event"] = kernel
    return {
        "benchmark": "billing",
        "machine": {"commit": "c2", "dirty": False},
        "load_start": {"at": at, "load_1_5_15": [1.0, 0.0, 0.0]},
        "results": [row],
    }


def test_billing_shows_the_kernels_share_and_faults_of_the_runs_that_measured_them() -> None:
    runs = [
        billing("2026-12-04T01:00:00", 120_000, (1.0, 0.1)),
        billing("2026-12-04T02:00:00", 130_000, (3.0, 0.3)),
        billing("2026-12-04T03:00:00", 90_000),  # written before the two figures existed
    ]
    built = summary.build_summary({"billing": runs})
    figures = built["figures"]
    assert figures["billing.events_per_core_s"]["median"] == 120_000
    assert figures["billing.us_system_per_event"]["median"] == 2.0
    assert figures["billing.us_system_per_event"]["num_runs"] == 2
    assert figures["billing.minor_faults_per_event"]["max"] == 0.3
    by_key = {g["key"]: g for g in built["goals"]}
    assert by_key["billing"]["verdict"] == "met"
    assert by_key["billing"]["beside"] == [
        "billing.us_system_per_event",
        "billing.minor_faults_per_event",
    ]


@pytest.mark.parametrize(
    ("op", "value", "expected"),
    [(">=", 5000, "met"), (">=", 4999, "not met"), ("<=", 10, "met"), ("<=", 10.1, "not met")],
)
def test_verdict_at_the_boundary(op: str, value: float, expected: str) -> None:
    target = 5000 if op == ">=" else 10
    assert summary.verdict(op, target, value) == expected


def test_per_side_relay_figures_are_per_core_of_each_side() -> None:
    relay = {
        "benchmark": "relay",
        "machine": {"commit": "c", "dirty": False},
        "load_start": {"at": "t", "load_1_5_15": [1.0, 1.0, 1.0]},
        "results": [
            {"tokens_per_step": 4, "num_tenants": 10, "us_per_token": {"worker_loop": 1.0}},
            {
                "tokens_per_step": 1,
                "num_tenants": 10,
                "concurrency": 64,
                "us_per_token": {"worker_loop": 40.0, "client": 25.0, "broker": 20.0},
            },
        ],
    }
    figures = summary.build_summary({"relay": [relay]})["figures"]
    assert figures["relay.worker_loop_tokens_per_core_s"]["median"] == 25_000
    assert figures["relay.client_tokens_per_core_s"]["median"] == 40_000
    assert figures["relay.broker_us_per_token"]["median"] == 20.0
    # 64 requests over 10 tenants, one reply topic: ~6.4 tokens per record.
    assert figures["relay.tokens_per_record"]["median"] == pytest.approx(6.4, abs=0.01)


def test_load_results_reads_only_stamped_files(tmp_path: Path) -> None:
    good = admission("t", 1.0)
    (tmp_path / "admission-20261201-101010.json").write_text(json.dumps(good))
    (tmp_path / "admission-latest.json").write_text(json.dumps(good))
    (tmp_path / "admission-profile-20261201-101010.json").write_text(json.dumps(good))
    found = summary.load_results(tmp_path)
    assert list(found) == ["admission"]
    assert [r["source"] for r in found["admission"]] == ["admission-20261201-101010.json"]


def test_collect_passes_what_follows_the_double_dash_to_the_script() -> None:
    ours, theirs = summary.split_script_args(
        ["collect", "admission", "--runs", "1", "--", "--requests", "2000", "--", "x"]
    )
    assert ours == ["collect", "admission", "--runs", "1"]
    assert theirs == ["--requests", "2000", "--", "x"]
    assert summary.split_script_args(["build"]) == (["build"], [])


def test_a_benchmark_without_results_here_keeps_its_earlier_figures() -> None:
    earlier = summary.build_summary(
        {"admission": [admission("2026-12-01T10:00:00", 900)], "overhead": [overhead("x")]}
    )
    newer = summary.build_summary(
        {"admission": [admission("2026-12-02T10:00:00", 1100)]}, earlier=earlier
    )
    assert newer["figures"]["admission.requests_per_job_core_s"]["median"] == 1100
    kept = [k for k in earlier["figures"] if not k.startswith("admission.")]
    assert "ttft.added_p50_ms" in kept  # the overhead script's figures
    assert all(newer["figures"][k] == earlier["figures"][k] for k in kept)
    fresh = summary.build_summary({"admission": [admission("2026-12-02T10:00:00", 1100)]})
    assert "ttft.added_p50_ms" not in fresh["figures"]


def test_a_picks_cost_per_worker_is_the_slope_between_the_fewest_and_most_workers() -> None:
    def point(num_workers: int, us: float) -> dict[str, Any]:
        return {"num_workers": num_workers, "us_per_pick": {"median": us}}

    route = {
        "benchmark": "route_cost",
        "machine": {"commit": "c", "dirty": False},
        "load_start": {"at": "t", "load_1_5_15": [1.0, 1.0, 1.0]},
        "results": [point(64, 23.0), point(1, 3.0), point(256, 83.0), point(8, 5.0)],
    }
    figures = summary.build_summary({"route_cost": [route]})["figures"]
    slope = figures["route_cost.us_per_pick_per_worker"]["median"]
    assert slope == pytest.approx(80 / 255, abs=1e-3)
    lone = {**route, "results": [point(1, 3.0)]}
    assert (
        "route_cost.us_per_pick_per_worker"
        not in (summary.build_summary({"route_cost": [lone]})["figures"])
    )


def test_the_c1_goal_shows_the_stacks_own_spans_where_a_run_measured_them() -> None:
    old, new = overhead("2026-12-01T10:00:00"), overhead("2026-12-01T11:00:00")
    new["results"][0]["path_spans_ms"] = {
        "bus.dispatch": {"p50": 4.4},
        "job": {"p50": 0.6},
        "worker_own": {"p50": 1.8},
    }
    built = summary.build_summary({"overhead": [old, new]})
    figures = built["figures"]
    # The run before the spans were read has none: it neither counts nor fails the build.
    assert figures["ttft.job_spans_p50_ms"]["median"] == 0.6
    assert figures["ttft.job_spans_p50_ms"]["num_runs"] == 1
    assert figures["ttft.job_to_worker_hop_p50_ms"]["median"] == 4.4
    assert figures["ttft.worker_own_spans_p50_ms"]["median"] == 1.8
    by_key = {g["key"]: g for g in built["goals"]}
    assert "ttft.worker_own_spans_p50_ms" in by_key["ttft_p50"]["beside"]


def on(result: dict[str, Any], cpu: str, num_cpus: int = 2) -> dict[str, Any]:
    """``result`` as measured on a machine with that CPU model."""
    return {**result, "machine": {**result["machine"], "cpu": cpu, "num_cpus": num_cpus}}


def test_figures_come_only_from_the_newest_runs_machine() -> None:
    fast = on(admission("2026-12-01T10:00:00", 6000), "Xeon")
    slow = [on(admission(f"2026-12-02T1{i}:00:00", 2500 + i), "EPYC") for i in range(2)]
    built = summary.build_summary({"admission": [fast, *slow]})
    assert built["machine"]["key"] == "EPYC, 2 CPUs"
    figure = built["figures"]["admission.requests_per_job_core_s"]
    assert figure["values"] == [2501, 2500]  # the Xeon's 6,000 is not among them
    assert built["other_machines"] == []


def test_an_earlier_summary_of_another_machine_is_kept_whole_and_apart() -> None:
    xeon = summary.build_summary(
        {
            "admission": [on(admission("2026-12-01T10:00:00", 6000), "Xeon")],
            "overhead": [on(overhead("2026-12-01T11:00:00"), "Xeon")],
        },
        generated_at="then",
    )
    epyc = summary.build_summary(
        {"admission": [on(admission("2026-12-02T10:00:00", 2500), "EPYC")]},
        earlier=xeon,
        generated_at="now",
    )
    # The overhead script did not run on the EPYC: its goals are not measured there,
    # not borrowed from the Xeon.
    assert "ttft.added_p50_ms" not in epyc["figures"]
    verdicts = {g["key"]: g["verdict"] for g in epyc["goals"]}
    assert verdicts["ttft_p50"] == "not measured"
    [kept] = epyc["other_machines"]
    assert kept["machine"]["key"] == "Xeon, 2 CPUs"
    assert kept["generated_at"] == "then"
    assert kept["figures"] == xeon["figures"]
    assert kept["goals"] == xeon["goals"]
    # Back on the Xeon: its own figures come back as the earlier ones of the same
    # machine, the EPYC's summary is kept, and no machine is listed twice.
    again = summary.build_summary(
        {"admission": [on(admission("2026-12-03T10:00:00", 6100), "Xeon")]},
        earlier=epyc,
        generated_at="later",
    )
    assert again["machine"]["key"] == "Xeon, 2 CPUs"
    assert [m["machine"]["key"] for m in again["other_machines"]] == ["EPYC, 2 CPUs"]
    assert "ttft.added_p50_ms" not in again["figures"]  # the Xeon's own was dropped with it


def test_a_summary_that_named_no_machine_is_kept_as_not_recorded() -> None:
    legacy = summary.build_summary({"admission": [admission("2026-12-01T10:00:00", 6000)]})
    legacy.pop("machine")
    legacy.pop("other_machines")
    built = summary.build_summary(
        {"admission": [on(admission("2026-12-02T10:00:00", 2500), "EPYC")]}, earlier=legacy
    )
    [kept] = built["other_machines"]
    assert kept["machine"] == {"key": summary.UNRECORDED}
    assert kept["figures"]["admission.requests_per_job_core_s"]["median"] == 6000
    # With no result at all, the earlier summary stays what it was, of its own machine.
    unchanged = summary.build_summary({}, earlier=built)
    assert unchanged["machine"] == built["machine"]
    assert unchanged["figures"] == built["figures"]
    assert unchanged["other_machines"] == built["other_machines"]


def test_the_machines_floors_are_figures_of_their_own() -> None:
    def floors(cpu_us: float) -> dict[str, Any]:
        trip = {"wall_us": {"median": 40.0}, "cpu_us": {"median": cpu_us}}
        return {
            "benchmark": "machine",
            "machine": {"commit": "c", "dirty": False, "cpu": "EPYC", "num_cpus": 2},
            "load_start": {"at": f"2026-12-02T10:00:{cpu_us:02.0f}", "load_1_5_15": [0.1, 0, 0]},
            "results": [
                {
                    "cross_core": trip,
                    "same_core": {"wall_us": {"median": 6.0}, "cpu_us": {"median": 3.0}},
                    "syscall_ns": {"median": 210.0},
                    "python_us": {"median": 590.0},
                }
            ],
        }

    figures = summary.build_summary({"machine": [floors(14.0), floors(16.0)]})["figures"]
    assert figures["machine.cross_core_cpu_us"]["median"] == 15.0
    assert figures["machine.same_core_cpu_us"]["median"] == 3.0
    assert figures["machine.syscall_ns"]["median"] == 210.0
    one_cpu = floors(14.0)
    one_cpu["results"][0]["cross_core"] = None
    alone = summary.build_summary({"machine": [one_cpu]})["figures"]
    assert "machine.cross_core_cpu_us" not in alone
    assert alone["machine.python_us"]["median"] == 590.0


def test_the_job_s_own_work_is_shown_beside_admission() -> None:
    def work(at: str, traced: float, tracing: float) -> dict[str, Any]:
        return {
            "benchmark": "admit_work",
            "machine": {"commit": "c1", "dirty": False},
            "load_start": {"at": at, "load_1_5_15": [0.5, 0.0, 0.0]},
            "traced": {"median": traced, "min": traced - 5, "max": traced + 5},
            "tracing": {"median": tracing, "min": tracing - 1, "max": tracing + 1},
        }

    runs = [work("2026-12-01T10:00:0" + str(n), 200.0 + n, 20.0 + n) for n in range(3)]
    built = summary.build_summary({"admission": [admission("x", 3000)], "admit_work": runs})
    traced = built["figures"]["admit_work.traced_us_per_request"]
    assert (traced["median"], traced["min"], traced["max"]) == (201.0, 200.0, 202.0)
    assert built["figures"]["admit_work.tracing_us_per_request"]["median"] == 21.0
    by_key = {g["key"]: g for g in built["goals"]}
    assert {"admit_work.traced_us_per_request", "admit_work.tracing_us_per_request"} <= set(
        by_key["admission"]["beside"]
    )
