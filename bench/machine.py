"""The machine's own floors, measured beside the goals.

    python -m bench.machine [--round-trips 20000] [--repeat 5]

tokenbus's figures are CPU per unit, which load disturbs little, but the machine moves
them: a goal met on one development VM can be missed on the next, with the same code.
The stack's processes sleep and wake for every fetch and every produce, so what a wakeup
costs here is the floor under their CPU per token. This script measures, with nothing of
tokenbus running:

- a wakeup across cores: two processes pinned to different CPUs pass one byte back and
  forth over pipes; one side's CPU and the wall time per round trip;
- the same on one core, which needs no inter-processor interrupt;
- a wakeup from idle: the same across cores, but the other side sleeps 0.5 ms before it
  answers, so this side's CPU goes idle between round trips, as a stack's do between
  fetches; one side's CPU per round trip;
- one system call (``getppid``), CPU per call;
- a fixed piece of pure Python (dicts, strings, a loop), CPU per piece.

Each is the median of ``--repeat`` repeats, with min..max. ``bench.summary`` shows them
in the heading of the machine's goals table.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.common import at_least_one
from bench.report import uptime_load, write_result
from bench.stats import spread

IDLE_DELAY_S = 0.0005
"""How long the other side sleeps before each answer in the wakeup-from-idle probe."""


def ping_pong(
    round_trips: int, cpus: tuple[int, int] | None, delay_s: float = 0.0
) -> tuple[float, float]:
    """µs per round trip between this process and a child over two pipes: (wall, this
    side's CPU). ``cpus`` pins this process and the child (None: leave both unpinned);
    the child sleeps ``delay_s`` before each answer."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[0]})
    pid = os.fork()
    if pid == 0:  # the child: echo every byte, then leave without Python's cleanup
        try:
            if cpus is not None:
                os.sched_setaffinity(0, {cpus[1]})
            os.write(to_parent_w, b"r")
            for _ in range(round_trips):
                os.read(to_child_r, 1)
                if delay_s:
                    time.sleep(delay_s)
                os.write(to_parent_w, b"x")
        finally:
            os._exit(0)
    try:
        os.read(to_parent_r, 1)  # the child is pinned and ready
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(round_trips):
            os.write(to_child_w, b"x")
            os.read(to_parent_r, 1)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, before)
        for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
            os.close(fd)
    return 1e6 * wall / round_trips, 1e6 * cpu / round_trips


def syscall_ns(calls: int = 200_000) -> float:
    """CPU ns of one ``getppid``: a system call that does almost nothing."""
    getppid = os.getppid
    cpu = time.process_time()
    for _ in range(calls):
        getppid()
    return 1e9 * (time.process_time() - cpu) / calls


def _python_piece() -> int:
    """A fixed piece of interpreter work: dict writes and reads, string formatting."""
    table: dict[str, int] = {}
    for i in range(1_000):
        table[f"tenant-{i % 97:04d}"] = table.get(f"tenant-{i % 89:04d}", 0) + i
    return sum(table.values())


def python_us(pieces: int = 500) -> float:
    """CPU µs of one ``_python_piece``."""
    cpu = time.process_time()
    for _ in range(pieces):
        _python_piece()
    return 1e6 * (time.process_time() - cpu) / pieces


def measure(round_trips: int, repeat: int) -> dict[str, Any]:
    """Every floor, ``repeat`` times each, as median and min..max."""
    cross = (0, 1) if len(os.sched_getaffinity(0)) > 1 else None

    def repeated(probe: Callable[[], float]) -> dict[str, float]:
        return spread([probe() for _ in range(repeat)])

    def trips(
        cpus: tuple[int, int] | None, num: int = round_trips, delay_s: float = 0.0
    ) -> dict[str, dict[str, float]]:
        runs = [ping_pong(num, cpus, delay_s) for _ in range(repeat)]
        return {
            "wall_us": spread([wall for wall, _ in runs]),
            "cpu_us": spread([cpu for _, cpu in runs]),
        }

    return {
        "round_trips": round_trips,
        "repeat": repeat,
        "cross_core": None if cross is None else trips(cross),
        "same_core": trips((0, 0)),
        # Fewer round trips: each waits out the other side's sleep.
        "idle_wake": None
        if cross is None
        else trips(cross, max(1, round_trips // 10), IDLE_DELAY_S),
        "syscall_ns": repeated(syscall_ns),
        "python_us": repeated(python_us),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--round-trips", type=at_least_one, default=20_000)
    parser.add_argument("--repeat", type=at_least_one, default=5)
    parser.add_argument("--name", default="machine")
    args = parser.parse_args(argv)
    load_start = uptime_load()
    floors = measure(args.round_trips, args.repeat)
    path = write_result(
        args.name, {"load_start": load_start, "load_end": uptime_load(), "results": [floors]}
    )
    for side in ("cross_core", "same_core", "idle_wake"):
        trip = floors[side]
        if trip is None:
            print(f"{side}: one CPU only, not measured")
            continue
        print(
            f"{side} round trip: {trip['wall_us']['median']:.1f} µs wall, "
            f"{trip['cpu_us']['median']:.1f} µs CPU of one side"
        )
    print(f"getppid: {floors['syscall_ns']['median']:.0f} ns CPU")
    print(f"a fixed piece of Python: {floors['python_us']['median']:.0f} µs CPU")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
