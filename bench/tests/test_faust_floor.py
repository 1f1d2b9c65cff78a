"""bench.faust_floor's arithmetic: medians with their spread, and each floor's share of
the job taken within each repeat (so a slow repeat moves both sides of its ratio)."""

from __future__ import annotations

import pytest

from bench.faust_floor import shares, spread, us_per_request
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
