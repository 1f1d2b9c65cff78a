from __future__ import annotations

from pathlib import Path

from bench.profile import top_frames


def test_self_and_inclusive_shares_from_collapsed_stacks(tmp_path: Path) -> None:
    raw = tmp_path / "profile.txt"
    raw.write_text(
        "main (app/__main__.py:3);handle (jobs/dispatcher.py:10);decode (schemas/codec.py:27) 6\n"
        "main (app/__main__.py:3);handle (jobs/dispatcher.py:10) 2\n"
        "main (app/__main__.py:3);select (selectors.py:468) 2\n"
    )
    profile = top_frames(raw, num_frames=3)
    assert profile["num_samples"] == 10
    assert profile["self"][0] == {"frame": "decode (schemas/codec.py:27)", "pct": 60.0}
    inclusive = {row["frame"]: row["pct"] for row in profile["inclusive"]}
    assert inclusive["main (app/__main__.py:3)"] == 100.0
    assert inclusive["handle (jobs/dispatcher.py:10)"] == 80.0


def test_a_missing_profile_is_empty(tmp_path: Path) -> None:
    assert top_frames(tmp_path / "none.txt")["num_samples"] == 0
