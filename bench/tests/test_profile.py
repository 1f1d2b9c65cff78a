from __future__ import annotations

from pathlib import Path

from bench.profile import merge_raw, top_frames


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


def test_profiles_of_one_process_merge_into_one_count(tmp_path: Path) -> None:
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("main (app.py:1);fetch (fetcher.py:9) 3")  # no final newline
    second.write_text("main (app.py:1);fetch (fetcher.py:9) 1\nmain (app.py:1);admit (d.py:4) 4\n")
    merged = merge_raw([first, second, tmp_path / "never-written.txt"], tmp_path / "all.txt")
    profile = top_frames(merged)
    assert profile["num_samples"] == 8
    assert profile["self"][0] == {"frame": "fetch (fetcher.py:9)", "pct": 50.0}
    assert {r["frame"]: r["pct"] for r in profile["self"]}["admit (d.py:4)"] == 50.0
