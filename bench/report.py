"""Where results go: JSON under bench/results/, with the machine and its load."""

from __future__ import annotations

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
        "git": _git_head(),
    }


def _git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=RESULTS_DIR.parent,
        )
    except OSError:
        return "?"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
        cwd=RESULTS_DIR.parent,
    ).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def uptime_load() -> dict[str, Any]:
    """What ``uptime`` says, kept with every result: the machine is shared and noisy."""
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
