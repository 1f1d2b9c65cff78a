from __future__ import annotations

from pathlib import Path

from bench.profile import merge_raw, package_of, top_frames


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


def test_self_time_is_summed_by_the_package_its_code_is_in(tmp_path: Path) -> None:
    site = "/v/lib/python3.12/site-packages"
    raw = tmp_path / "profile.txt"
    raw.write_text(
        f"main (/w/stream_jobs/__main__.py:21);run (/w/stream_jobs/dispatcher.py:9) 5\n"
        f"main (/w/stream_jobs/__main__.py:21);send ({site}/aiokafka/client.py:474) 3\n"
        f"execute (mode/worker.py:264) 2\n"
    )
    profile = top_frames(raw)
    assert profile["by_package"] == [
        {"package": "tokenbus", "pct": 50.0},
        {"package": "aiokafka", "pct": 30.0},
        {"package": "event loop", "pct": 20.0},
    ]


def test_package_of_a_frame() -> None:
    site = "/v/lib/python3.12/site-packages"
    assert package_of(f"validate ({site}/pydantic/main.py:792)") == "pydantic"
    assert package_of(f"x ({site}/six.py:1)") == "six"
    assert package_of("wait (/usr/lib/python3.12/asyncio/tasks.py:428)") == "asyncio"
    assert package_of("select (/usr/lib/python3.12/selectors.py:468)") == "stdlib"
    assert package_of("_run_code (<frozen runpy>:88)") == "stdlib"
    assert package_of("run (/usr/lib/python3.12/asyncio/runners.py:118)") == "event loop"
    assert package_of("chunk (/work/main/workers/worker.py:203)") == "tokenbus"
    assert package_of("lane (/work/main/bench/relay.py:125)") == "other"
    # As py-spy names files: from their sys.path entry.
    assert package_of("send (aiokafka/client.py:474)") == "aiokafka"
    assert package_of("admit (stream_jobs/dispatcher.py:422)") == "tokenbus"
    assert package_of("_bootstrap (threading.py:1002)") == "stdlib"
    assert package_of("write (asyncio/streams.py:343)") == "asyncio"
    assert package_of("_start_thread (mode/threads.py:211)") == "event loop"
    assert package_of("wait_for (aiokafka/util.py:44)") == "aiokafka"
    assert package_of("<lambda> (<string>:1)") == "other"
