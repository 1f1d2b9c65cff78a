"""``bench.common.run_benchmark``: a benchmark's ``main``, and the name of its result."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from bench import common


def run(monkeypatch: pytest.MonkeyPatch, argv: list[str], name: Any) -> list[tuple[str, Any]]:
    written: list[tuple[str, Any]] = []

    def write_result(result_name: str, result: dict[str, Any]) -> Path:
        written.append((result_name, result))
        return Path(result_name)

    monkeypatch.setattr(common, "write_result", write_result)
    monkeypatch.setattr(common, "exit_on_sigterm", lambda: None)
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="plain")
    parser.add_argument("--profile", action="store_true")
    shown: list[dict[str, Any]] = []

    async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
        return {"argv": args.argv}

    common.run_benchmark(parser, argv, measure, lambda result, _: shown.append(result), name)
    assert shown == [written[0][1]]
    return written


def test_the_result_is_named_by_the_name_given_or_by_the_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert run(monkeypatch, [], None) == [("plain", {"argv": []})]
    assert run(monkeypatch, ["--name", "x"], "fixed")[0][0] == "fixed"

    def by_args(args: argparse.Namespace) -> str:
        return str(args.name) + ("-profile" if args.profile else "")

    assert run(monkeypatch, ["--profile"], by_args) == [("plain-profile", {"argv": ["--profile"]})]


def test_a_stage_result_is_named_by_name_else_by_stage_and_profile() -> None:
    named = common.profiled_name("relay")

    assert named(argparse.Namespace(name=None, profile=False)) == "relay"
    assert named(argparse.Namespace(name=None, profile=True)) == "relay-profile"
    assert named(argparse.Namespace(name="mine", profile=True)) == "mine"


def test_pin_job_takes_only_cpus_this_machine_lets_it_use() -> None:
    parser = argparse.ArgumentParser()
    common.add_pin_job_arg(parser)
    usable = sorted(os.sched_getaffinity(0))
    assert parser.parse_args([]).pin_job == []
    assert parser.parse_args(["--pin-job", *map(str, usable)]).pin_job == usable
    for bad in (str(max(usable) + 1), "-1", "zero"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--pin-job", bad])
