from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench.ttft_modes import histogram, main, modes, positive_ms


def request(ttft: float, legs: tuple[float, float, float], **spans: float) -> dict[str, Any]:
    return {
        "ttft": ttft,
        "client_to_dispatched": legs[0],
        "dispatched_to_worker_first_token": legs[1],
        "worker_first_token_to_client": legs[2],
        "spans": {name.replace("_", "."): ms for name, ms in spans.items()},
    }


def test_the_histogram_counts_requests_per_bin_from_its_lower_edge() -> None:
    assert histogram([14.0, 16.9, 17.0, 33.2, 35.9], 3.0) == {12.0: 1, 15.0: 2, 33.0: 2}


def test_the_modes_split_at_the_given_ttft_and_take_each_medians() -> None:
    requests = [
        request(15.0, (6.0, 7.0, 2.0), bus_dispatch=3.0),
        request(17.0, (7.0, 8.0, 2.0), bus_dispatch=3.4),
        request(19.0, (8.0, 9.0, 2.0)),  # a request without its spans
        request(34.0, (12.0, 13.0, 9.0), bus_dispatch=7.0),
    ]
    out = modes(requests, 26.0)
    assert out["fast"] == {
        "requests": 3,
        "ttft": 17.0,
        "client_to_dispatched": 7.0,
        "dispatched_to_worker_first_token": 8.0,
        "worker_first_token_to_client": 2.0,
        "spans": {"bus.dispatch": 3.2},
    }
    assert out["slow"]["requests"] == 1 and out["slow"]["spans"] == {"bus.dispatch": 7.0}
    assert set(modes(requests[:1], 26.0)) == {"fast"}


def test_a_bin_width_must_be_a_finite_number_above_zero() -> None:
    assert positive_ms("2.5") == 2.5
    for text in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_ms(text)


def test_a_file_that_is_not_an_overhead_result_is_named_and_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "summary.json"
    other.write_text('{"goals": []}')
    main([str(other), str(tmp_path / "missing.json")])
    out = capsys.readouterr().out
    assert "summary.json: not a bench.overhead result (KeyError" in out
    assert "missing.json: not a bench.overhead result (FileNotFoundError" in out
