"""Where results go: JSON under bench/results/, with the machine and its load."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.procstat import load_average

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "mem_gib": round(mem_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "git": git_state()["commit"][:7] + ("+dirty" if git_state()["dirty"] else ""),
        **git_state(),
    }


def _git(*argv: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *argv], capture_output=True, text=True, check=False, cwd=RESULTS_DIR.parent
        )
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# What the benchmarks write and what is written of their runs, not what they measure:
# editing these leaves the tree clean.
GENERATED = ("BENCHMARKS.md", "bench/JOURNAL.md", "bench/summary.json")


def _changes() -> str | None:
    """Tracked files that differ from HEAD, in the whole repository."""
    excluded = [f":(top,exclude){path}" for path in GENERATED]
    return _git("status", "--porcelain", "--untracked-files=no", "--", ":/", *excluded)


@functools.cache
def git_state() -> dict[str, Any]:
    """The commit a result was measured on, and whether tracked files differed from it:
    ``bench.summary`` takes figures only from results of a clean tree. Read once, at the
    run's start (``uptime_load``), so a commit made during a run is not taken for it."""
    commit = _git("rev-parse", "HEAD")
    changes = _changes()
    return {"commit": commit or "?", "dirty": commit is None or changes is None or bool(changes)}


def uptime_load() -> dict[str, Any]:
    """What ``uptime`` says, kept with every result: the machine is shared and noisy."""
    git_state()  # every script calls this first: the tree as the run found it
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_1_5_15": load_average()}


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Writes ``<name>-<timestamp>.json`` and ``<name>-latest.json``; returns the first."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    text = json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2)
    path = RESULTS_DIR / f"{name}-{stamp}.json"
    path.write_text(text)
    (RESULTS_DIR / f"{name}-latest.json").write_text(text)
    return path
