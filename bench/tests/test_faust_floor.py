"""bench.faust_floor's arithmetic: medians with their spread, and each floor's share of
the job taken within each repeat (so a slow repeat moves both sides of its ratio)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.faust_floor import pooled_profiles, shares, spread, us_per_request
from bench.faust_floor_app import create_floor_app
from tokenbus.config import Settings


def test_spread_is_the_median_with_min_and_max() -> None:
    assert spread([300.0, 100.0, 200.0]) == {"median": 200.0, "min": 100.0, "max": 300.0}


def test_shares_pair_each_repeat_with_its_own_job_run() -> None:
    runs = {"forward": [100.0, 300.0], "ledger": [200.0, 450.0], "job": [1000.0, 1500.0]}
    # Within each repeat: 10% and 20%, 20% and 30%. The medians pooled first would give
    # 200 / 1250 = 16% and 325 / 1250 = 26%.
    assert shares(runs) == {
        "forward": {"median": 15.0, "min": 10.0, "max": 20.0},
        "ledger": {"median": 25.0, "min": 20.0, "max": 30.0},
    }


def test_cpu_per_request_counts_what_was_forwarded() -> None:
    row = {"cpu_s": {"stream_job": 0.5}, "num_forwarded": 2000}
    assert us_per_request(row) == 250.0


def test_an_unknown_mode_is_refused_before_any_app_is_made() -> None:
    with pytest.raises(ValueError, match="BENCH_FLOOR_MODE"):
        create_floor_app(Settings(), "everything", "some-topic")


async def test_the_floor_without_faust_refuses_an_unknown_mode_before_connecting() -> None:
    import asyncio

    from bench.aiokafka_floor_app import forward

    with pytest.raises(ValueError, match="BENCH_FLOOR_MODE"):
        await forward(Settings(), "everything", "some-topic", asyncio.Event())


def test_a_floor_run_made_before_an_arm_existed_has_no_figure_for_it() -> None:
    from bench.summary import _median

    old = {"us_per_request": {"forward": {"median": 100.0}, "ledger": {"median": 150.0}}}
    new = {"us_per_request": {**old["us_per_request"], "aiokafka_ledger": {"median": 14.0}}}
    assert _median("us_per_request", "aiokafka_ledger")(old) is None
    assert _median("us_per_request", "aiokafka_ledger")(new) == 14.0


def test_shares_cover_every_floor_arm_run() -> None:
    runs = {"forward": [100.0], "aiokafka_forward": [10.0], "job": [200.0]}
    assert set(shares(runs)) == {"forward", "aiokafka_forward"}


def test_a_profile_pools_each_arms_repeats_and_keeps_the_arms_apart(tmp_path: Path) -> None:
    def raw(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    frame = "run (faust/streams.py:10);deliver (faust/transport/conductor.py:20)"
    pooled = pooled_profiles(
        {
            "forward": [raw("f0", f"{frame} 3\n"), raw("f1", f"{frame} 1\n")],
            "job": [raw("j0", "admit (stream_jobs/dispatcher.py:1) 5\n")],
            "ledger": [],  # not profiled: no entry
        },
        tmp_path / "pooled",
    )
    assert set(pooled) == {"forward", "job"}
    assert pooled["forward"]["num_samples"] == 4  # both repeats' samples
    assert pooled["job"]["num_samples"] == 5
    assert pooled["forward"]["self"][0]["frame"].startswith("deliver")
