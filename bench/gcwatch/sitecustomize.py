"""What the cycle collector costs each Python process of a run: put this directory on
``PYTHONPATH`` and every process started with it (the stack's services and the
benchmark's own) writes, every second and at exit, one line to
``$GCWATCH_DIR/<pid>`` (default ``/tmp/gcwatch``): its command line, its collector
thresholds and frozen objects, the collections of each generation and the CPU seconds
they took, its own CPU seconds, and each full collection's wall time (epoch s) and ms.

    rm -rf /tmp/gcwatch
    PYTHONPATH=bench/gcwatch .venvs/stream/bin/python -m bench.admission --requests 10000
    cat /tmp/gcwatch/*

A diagnostic, not a benchmark: it adds a callback to every collection. Compare
``TOKENBUS_GC_GEN0_THRESHOLD=700`` (CPython's) against the default (BENCHMARKS.md).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
from typing import Any

_DIR = os.environ.get("GCWATCH_DIR", "/tmp/gcwatch")
_started: dict[int, float] = {}
_cpu_s = [0.0, 0.0, 0.0]
_count = [0, 0, 0]
_full: list[tuple[float, float]] = []


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    generation = info["generation"]
    if phase == "start":
        _started[generation] = time.thread_time()
        return
    took = time.thread_time() - _started.pop(generation, time.thread_time())
    _cpu_s[generation] += took
    _count[generation] += 1
    if generation == 2:
        _full.append((round(time.time(), 1), round(1000 * took, 1)))


def _write() -> None:
    command = " ".join(sys.argv)[:120]
    line = (
        f"{command} | thresholds {gc.get_threshold()} frozen {gc.get_freeze_count()} | "
        f"collections {_count} cpu_s {[round(s, 3) for s in _cpu_s]} | "
        f"process cpu_s {time.process_time():.2f} | full (at, ms) {_full}\n"
    )
    with open(os.path.join(_DIR, str(os.getpid())), "w") as out:
        out.write(line)


def _every_second() -> None:
    while True:
        time.sleep(1.0)
        _write()


os.makedirs(_DIR, exist_ok=True)
gc.callbacks.append(_on_collection)
threading.Thread(target=_every_second, name="gcwatch", daemon=True).start()
atexit.register(_write)
