"""py-spy around a process, and the top frames of what it recorded.

``Profiler(pid, out)`` starts ``py-spy record`` in raw (collapsed stack) format, sampling
without pausing the target; ``stop()`` ends it (SIGINT makes py-spy write its file) and
``top_frames`` reads the file: self time (leaf frames), inclusive time, and self time by
the package its code is in.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

RATE_HZ = 200
PLUMBING = (
    "<frozen runpy>",
    "asyncio/runners.py",
    "asyncio/base_events.py",
    "asyncio/events.py",
    "threading.py",
    "mode/threads.py",
    "mode/worker.py",
    "<module> (",
)
"""Frames every sample passes through (entry points, the event loop): left out of the
inclusive list, where they would only say 100%."""


def py_spy() -> str:
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise RuntimeError("py-spy is not installed: pip install -e '.[dev]' in .venvs/stream")
    return found


class Profiler:
    def __init__(self, pid: int, out: Path, *, idle: bool = False) -> None:
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        argv = [py_spy(), "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw"]
        argv += ["--nonblocking", "--output", str(out)]
        if idle:
            argv.append("--idle")
        self._process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def stop(self) -> Path:
        if self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGINT)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        return self.out


def merge_raw(parts: list[Path], out: Path) -> Path:
    """The collapsed stacks of ``parts`` (one profile of the same process, stopped and
    started again) as one file: ``top_frames`` adds up repeated stacks."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as merged:
        for part in parts:
            if part.exists():
                text = part.read_text(errors="replace")
                merged.write(text if text.endswith("\n") or not text else text + "\n")
    return out


LOOP_ENTRIES = ("mode/worker.py", "mode/threads.py", "asyncio/runners.py", "uvloop/__init__.py")
"""Where a thread enters its event loop: a sample that ends there was in the loop's own
C code (uvloop's, the selector's wait), not in any Python frame above it."""
OWN_PACKAGES = frozenset(
    ("batches", "billing", "bridge", "producers", "schemas", "stream_jobs", "tokenbus", "workers")
)


def package_of(frame: str) -> str:
    """The package a collapsed-stack frame's code is in: the top-level module (py-spy
    names a file from its ``sys.path`` entry: ``aiokafka/client.py``), ``tokenbus`` for
    this project's own packages, ``asyncio`` and ``stdlib`` for the standard library,
    ``event loop`` for a loop's own C code."""
    where = frame.rpartition(" (")[2].rstrip(")").rpartition(":")[0]
    if any(where.endswith(entry) for entry in LOOP_ENTRIES):
        return "event loop"
    if where.startswith("<frozen"):
        return "stdlib"
    if where.startswith("<"):  # generated code: a namedtuple's or dataclass's methods
        return "other"
    parts = Path(where).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            parts = parts[parts.index(marker) + 1 :]
            break
    else:
        lib = next((i for i, part in enumerate(parts) if part.startswith("python3.")), None)
        if lib is not None:
            parts = parts[lib + 1 :]
        elif any(part in OWN_PACKAGES for part in parts[:-1]):
            return "tokenbus"
    if not parts or parts[0] == "/":
        return "other"
    top = parts[0].removesuffix(".py")
    if top in OWN_PACKAGES:
        return "tokenbus"
    if top == "asyncio":
        return "asyncio"
    return "stdlib" if top in sys.stdlib_module_names else top


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` --> ``func (file.py:123)``: short, still findable."""
    name, _, where = frame.partition(" (")
    if not where:
        return frame
    path, _, line = where.rstrip(")").rpartition(":")
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{name} ({short}:{line})" if line else f"{name} ({short})"


def top_frames(path: Path, num_frames: int = 15) -> dict[str, Any]:
    """Self and inclusive shares of the recorded samples, biggest first."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    total = 0
    if not path.exists():
        return {"num_samples": 0, "self": [], "inclusive": [], "by_package": []}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        # The first element is the thread ("process 123:\"python\";thread ..."); skip it.
        raw_frames = [f for f in stack.split(";") if " (" in f]
        if not raw_frames:
            continue
        frames = [_frame_name(f) for f in raw_frames]
        total += count
        packages[package_of(raw_frames[-1])] += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            if not any(marker in frame for marker in PLUMBING):
                inclusive[frame] += count

    def share(counter: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"frame": frame, "pct": round(100 * n / total, 1)}
            for frame, n in counter.most_common(num_frames)
        ]

    return {
        "num_samples": total,
        "self": share(self_counts),
        "inclusive": share(inclusive),
        "by_package": [{"package": r["frame"], "pct": r["pct"]} for r in share(packages)],
    }
