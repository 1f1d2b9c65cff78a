from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import markdown


def test_update_rewrites_only_the_marked_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        markdown, "render", lambda name, kind=None, current="": f"table of {name} ({kind})"
    )
    doc = tmp_path / "B.md"
    doc.write_text(
        "intro\n<!-- bench:relay -->\nold\n<!-- /bench:relay -->\nmiddle\n"
        "<!-- bench:overhead-x kind=overhead -->\n<!-- /bench:overhead-x -->\nend\n"
    )
    assert markdown.update(doc) == 2
    assert doc.read_text() == (
        "intro\n<!-- bench:relay -->\ntable of relay (None)\n<!-- /bench:relay -->\nmiddle\n"
        "<!-- bench:overhead-x kind=overhead -->\ntable of overhead-x (overhead)\n"
        "<!-- /bench:overhead-x -->\nend\n"
    )


def test_update_keeps_a_block_whose_source_is_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(markdown, "render", lambda name, kind=None, current="": None)
    doc = tmp_path / "B.md"
    text = "<!-- bench:relay -->\nmeasured once\n<!-- /bench:relay -->\n"
    doc.write_text(text)
    assert markdown.update(doc) == 0
    assert doc.read_text() == text


def _summary() -> dict[str, Any]:
    from bench import summary

    def result(benchmark: str, at: str, load: float, row: dict[str, Any]) -> dict[str, Any]:
        return {
            "benchmark": benchmark,
            "machine": {"commit": "0123456789abcdef", "dirty": False},
            "load_start": {"at": at, "load_1_5_15": [load, 0.0, 0.0]},
            "results": [row],
        }

    admission = [
        result(
            "admission",
            f"2026-12-01T1{i}:00:00",
            float(i),
            {
                "requests_per_core_s": 900.0 + 100 * i,
                "cpu_s": {"stream_job": 1.0},
                "num_forwarded": 1000,
                "broker_cpu_ms_per_1k": 300.0,
                "request_bytes": 800,
                "header_bytes": 200,
            },
        )
        for i in range(3)
    ]
    hop = [
        result(
            "hop",
            "2026-12-01T09:00:00",
            0.5,
            {"fetch_max_wait_ms": 20, "hop_ms": {"p50": 1.4, "p99": 2.5}},
        )
    ]
    return summary.build_summary({"admission": admission, "hop": hop}, generated_at="gen-time")


def test_goals_table_shows_median_spread_load_commit_and_verdict() -> None:
    table = markdown.goals(_summary())
    lines = table.splitlines()
    assert lines[0].startswith("_From `bench/summary.json` (gen-time)")
    admission = next(line for line in lines if line.startswith("| admission"))
    assert "**1,000 req/s (900..1,100)**, median of 3" in admission
    assert "| 1.0 (0.0..2.0) |" in admission
    assert "`0123456789`, 2026-12-01T12:00:00" in admission
    assert "job CPU per request 1,000 µs" in admission
    assert admission.endswith("| **not met** |")
    billing = next(line for line in lines if line.startswith("| billing"))
    assert billing.endswith("| - | - | - | - | not measured |")
    assert len([line for line in lines if line.startswith("| ")]) == 1 + len(_summary()["goals"])
    assert lines[-1] == (
        "Reported beside the goals: one broker hop p50, process to process (bench.hop) 1.40 ms "
        "(`0123456789`, load 0.5); one broker hop p99, process to process (bench.hop) 2.50 ms "
        "(`0123456789`, load 0.5); "
        "broker CPU per request (admission) 300 µs (300..300) (`0123456789`, load 1.0)."
    )


def test_goals_table_marks_fewer_than_three_runs_provisional() -> None:
    built = _summary()
    goal = next(g for g in built["goals"] if g["key"] == "admission")
    goal["num_runs"] = 1
    row = next(r for r in markdown.goals(built).splitlines() if r.startswith("| admission"))
    assert row.endswith("| **not met** (1 of 3 runs: provisional) |")


def test_capacity_names_the_missing_figures() -> None:
    text = markdown.capacity(_summary())
    assert text.startswith("_The capacity model needs these figures")
    assert "`billing.events_per_core_s`" in text
    assert "`admission.job_us_per_request`" not in text


def test_capacity_renders_a_row_per_fleet() -> None:
    from bench import capacity as cap

    figures = {key: {"median": 20.0} for key in cap.SOURCES.values()}
    figures["billing.events_per_core_s"] = {"median": 25_000.0}
    figures["bridge.tokens_per_core_s"] = {"median": 25_000.0}
    sizes = {"reply_record_one_chunk": 150, "reply_record_per_extra_chunk": 90, "usage_event": 500}
    text = markdown.capacity({"generated_at": "g", "figures": figures, "record_bytes": sizes})
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| 8", "| 64", "| 512"]
    assert "bridge 0.220 cores" in text
    assert "5-common-pitfalls-when-using-apache-kafka" in text


def test_update_rewrites_only_the_named_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(markdown, "render", lambda name, kind=None, current="": f"new {name}")
    doc = tmp_path / "B.md"
    doc.write_text(
        "<!-- bench:goals -->\nold\n<!-- /bench:goals -->\n"
        "<!-- bench:relay -->\nold\n<!-- /bench:relay -->\n"
    )
    assert markdown.update(doc, ["goals"]) == 1
    assert doc.read_text() == (
        "<!-- bench:goals -->\nnew goals\n<!-- /bench:goals -->\n"
        "<!-- bench:relay -->\nold\n<!-- /bench:relay -->\n"
    )


def test_each_machine_gets_its_own_table_under_a_heading_with_its_floors() -> None:
    from bench import summary

    def result(cpu: str, at: str, per_core: float) -> dict[str, Any]:
        return {
            "benchmark": "admission",
            "machine": {"commit": "0123456789abcdef", "dirty": False, "cpu": cpu, "num_cpus": 2},
            "load_start": {"at": at, "load_1_5_15": [1.0, 0.0, 0.0]},
            "results": [
                {
                    "requests_per_core_s": per_core,
                    "cpu_s": {"stream_job": 1.0},
                    "num_forwarded": 1000,
                    "broker_cpu_ms_per_1k": 300.0,
                    "request_bytes": 800,
                    "header_bytes": 200,
                }
            ],
        }

    floors = {
        "benchmark": "machine",
        "machine": {"commit": "0123456789abcdef", "dirty": False, "cpu": "EPYC", "num_cpus": 2},
        "load_start": {"at": "2026-12-02T09:00:00", "load_1_5_15": [0.1, 0.0, 0.0]},
        "results": [
            {
                "cross_core": {"wall_us": {"median": 41.0}, "cpu_us": {"median": 15.0}},
                "same_core": {"wall_us": {"median": 6.0}, "cpu_us": {"median": 3.0}},
                "syscall_ns": {"median": 214.0},
                "python_us": {"median": 590.0},
            }
        ],
    }
    xeon = summary.build_summary(
        {"admission": [result("Xeon", "2026-12-01T10:00:00", 6000.0)]}, generated_at="then"
    )
    epyc = summary.build_summary(
        {"admission": [result("EPYC", "2026-12-02T10:00:00", 2500.0)], "machine": [floors]},
        earlier=xeon,
        generated_at="now",
    )
    text = markdown.goals(epyc)
    first, second = text.index("**On `EPYC, 2 CPUs`**"), text.index("**On `Xeon, 2 CPUs`**")
    assert first < second
    assert "a wakeup across cores, one side's CPU per round trip 15.0 µs" in text[first:second]
    assert "kept from the summary of then" in text[second:]
    rows = [line for line in text.splitlines() if line.startswith("| admission")]
    assert "**2,500 req/s**" in rows[0] and "| **not met** (1 of 3 runs" in rows[0]
    assert "**6,000 req/s**" in rows[1] and "| **met** (1 of 3 runs" in rows[1]


def _frames(frame: str, samples: int) -> dict[str, Any]:
    return {
        "num_samples": samples,
        "self": [{"pct": 100.0, "frame": frame}],
        "inclusive": [{"pct": 100.0, "frame": frame}],
        "by_package": [{"package": "aiokafka", "pct": 100.0}],
    }


def test_a_profile_block_shows_each_results_and_the_runs_pooled_profiles() -> None:
    context = {"at": "2026-12-06T17:20:25", "load_1_5_15": [0.3, 0.8, 1.4]}
    result = {
        "benchmark": "faust_floor-profile",
        "machine": {"git": "815b24d"},
        "load_start": context,
        "load_end": context,
        "results": [{"arm": "forward"}, {"profile": _frames("admit (app.py:1)", 7)}],
        "profiles": {
            "forward": _frames("send (producer.py:2)", 528),
            "c=64": {"client": _frames("getmany (consumer.py:3)", 40)},
        },
    }
    text = markdown.profile(result)
    assert "**faust_floor-profile** (7 samples)" in text  # a result's own
    assert "**faust_floor-profile: forward** (528 samples)" in text  # pooled, by arm
    assert "**faust_floor-profile: c=64: client** (40 samples)" in text  # nested
    assert "`send (producer.py:2)`" in text
    assert text.count("Self time by package: aiokafka 100.0%.") == 3


def _overhead_run(at: str, git: str) -> dict[str, Any]:
    def row(concurrency: int, p50: float) -> dict[str, Any]:
        return {
            "concurrency": concurrency,
            "added_ttft_ms": {"p50": p50, "p99": 2 * p50},
            "ratios": {"throughput": 0.7},
            "pipeline_cpu_s_per_1k_tokens": 0.2,
        }

    return {
        "parameters": {"rounds": 3},
        "load_start": {"at": at, "load_1_5_15": [1.0, 0.0, 0.0]},
        "load_end": {"at": at, "load_1_5_15": [2.0, 0.0, 0.0]},
        "machine": {"git": git},
        "idle_stack_cores_during_direct": {"p50": 0.1},
        "results": [row(1, 20.0), row(64, 100.0)],
    }


def test_overhead_runs_keep_the_documents_rows_of_runs_with_no_file_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.setattr(markdown, "RESULTS_DIR", tmp_path)
    for at, git in (("2026-12-07T05:00:00", "new1"), ("2026-12-06T10:00:00", "again")):
        name = f"overhead-{at.replace(':', '')}.json"
        (tmp_path / name).write_text(json.dumps(_overhead_run(at, git)))
    doc = tmp_path / "B.md"
    header = markdown.overhead_runs().splitlines()[:2]
    old = [
        "| 2026-12-05T09:00:00 | as is (git old1) | 1.0 -> 1.0 | 18 / 40 | 90 | 0.70 | 2.00 "
        "| 0.100 | 0.1 |",
        "| 2026-12-06T10:00:00 | as is (git stale) | 1.0 -> 1.0 | 18 / 40 | 90 | 0.70 | 2.00 "
        "| 0.100 | 0.1 |",
    ]
    doc.write_text(
        "<!-- bench:overhead-runs -->\n"
        + "\n".join([*header, *old])
        + "\n<!-- /bench:overhead-runs -->\n"
    )
    assert markdown.update(doc) == 1
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| 2026")]
    # The run with no file stays; the one with a file is its file's; newest last.
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| 2026-12-05T09:00:00", "as is (git old1)"],
        ["| 2026-12-06T10:00:00", "as is (git again)"],
        ["| 2026-12-07T05:00:00", "as is (git new1)"],
    ]
