"""CPU seconds of processes, read from /proc: stdlib only, so both environments import it.

``/proc/<pid>/stat`` counts every thread of a process (utime + stime) but not its
children, which is what the overhead accounting needs: the worker's Python process
without the vLLM engine core it spawned.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from tokenbus.procfs import children, stat_fields

__all__ = [
    "CpuMeter",
    "children",
    "cpu_seconds",
    "descendants",
    "minor_faults",
    "pin_threads",
    "runqueue_wait_seconds",
    "system_seconds",
    "thread_cpu_seconds",
    "threads_split",
    "times_scheduled",
    "write_syscalls",
]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_counters(pid: int, *indexes: int) -> list[int]:
    """The given ``stat_fields`` of one process as integers; zeros once it has gone."""
    try:
        fields = stat_fields(f"/proc/{pid}/stat")
    except OSError:
        return [0] * len(indexes)
    return [int(fields[i]) for i in indexes]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (all its threads); 0.0 once it has gone."""
    return sum(_stat_counters(pid, 11, 12)) * _TICK_S


def system_seconds(pid: int) -> float:
    """The kernel's share of ``cpu_seconds``: system calls, page faults; 0.0 once gone."""
    return _stat_counters(pid, 12)[0] * _TICK_S


def minor_faults(pid: int) -> int:
    """Page faults of one process that needed no disk read (``minflt``): on a VM, each one
    whose page is new costs the kernel a zeroed page; 0 once the process has gone."""
    return _stat_counters(pid, 7)[0]


def write_syscalls(pid: int) -> int:
    """The write system calls of one process, all its threads (``syscw`` of
    ``/proc/<pid>/io``); 0 once it has gone. A Kafka client's writes are mostly its
    requests to the broker, one fetch or produce each, and its wakeups of its other
    threads (an eventfd): the count carries from one machine to the next, and on a VM
    each write to a socket costs the kernel far more than a plain system call."""
    try:
        with open(f"/proc/{pid}/io", "rb") as io:
            for line in io:
                if line.startswith(b"syscw:"):
                    return int(line[len(b"syscw:") :])
    except (OSError, ValueError):
        pass
    return 0


def _schedstat_sum(pid: int, index: int) -> int:
    """One field of ``/proc/<pid>/task/*/schedstat``, summed over the live threads; 0 once
    the process has gone. The fields: time on a CPU (ns), time runnable but waiting for
    one (ns), times put on a CPU."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as stat:
                total += int(stat.read().split()[index])
        except (OSError, IndexError, ValueError):
            continue
    return total


def runqueue_wait_seconds(pid: int) -> float:
    """Time the process's threads spent runnable but waiting for a CPU (schedstat).

    On a shared 2-core machine this is the part of a latency that is other people's
    load, not tokenbus: every hop wakes a process that may have to queue for a core.
    """
    return _schedstat_sum(pid, 1) / 1e9


def times_scheduled(pid: int) -> int:
    """How many times the process's live threads were put on a CPU (schedstat's third
    field, summed): about one per wakeup. What a wakeup costs depends on the machine
    (``bench.machine``), so this count is what carries from one machine to the next."""
    return _schedstat_sum(pid, 2)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU of each live thread of one process, by thread id (the main
    thread's id is the pid); {} once it has gone. A thread that ended is not in it."""
    seconds: dict[int, float] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return seconds
    for tid in tasks:
        try:
            fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) * _TICK_S
    return seconds


def pin_threads(pid: int, cpus: Iterable[int]) -> int:
    """Every live thread of process ``pid`` allowed only ``cpus`` (``taskset -a``): a
    thread it starts later inherits the mask of the thread that starts it. Returns how
    many threads were pinned; a thread that ends meanwhile is passed over."""
    allowed = set(cpus)
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    pinned = 0
    for tid in tasks:
        try:
            os.sched_setaffinity(int(tid), allowed)
        except ProcessLookupError:
            continue
        pinned += 1
    return pinned


def threads_split(
    pid: int, before: Mapping[int, float], after: Mapping[int, float]
) -> dict[str, float]:
    """CPU between two ``thread_cpu_seconds`` readings: the main thread's and the other
    threads' together (a thread that ended between them is not counted)."""
    main = after.get(pid, 0.0) - before.get(pid, 0.0)
    others = sum(s - before.get(tid, 0.0) for tid, s in after.items() if tid != pid)
    return {"main": round(main, 3), "other_threads": round(others, 3)}


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children(stack.pop()):
            found.append(child)
            stack.append(child)
    return found


def load_average() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return (round(one, 2), round(five, 2), round(fifteen, 2))


@dataclass
class CpuMeter:
    """Named groups of pids; ``delta()`` is the CPU each group spent since ``start()``."""

    groups: Mapping[str, Iterable[int]]

    def __post_init__(self) -> None:
        self.groups = {name: tuple(pids) for name, pids in self.groups.items()}
        self._start: dict[str, float] = {}
        self._start_wait: dict[str, float] = {}
        self._start_system: dict[str, float] = {}
        self._start_runs: dict[str, int] = {}
        self._start_writes: dict[str, int] = {}

    def _read(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(p) for p in pids) for name, pids in self.groups.items()}

    def _read_wait(self) -> dict[str, float]:
        return {
            name: sum(runqueue_wait_seconds(p) for p in pids) for name, pids in self.groups.items()
        }

    def _read_system(self) -> dict[str, float]:
        return {name: sum(system_seconds(p) for p in pids) for name, pids in self.groups.items()}

    def _count(self, read: Callable[[int], int]) -> dict[str, int]:
        """A per-process counter (``times_scheduled``, ``write_syscalls``), per group."""
        return {name: sum(read(p) for p in pids) for name, pids in self.groups.items()}

    def start(self) -> None:
        self._start_writes = self._count(write_syscalls)
        self._start = self._read()
        self._start_wait = self._read_wait()
        self._start_system = self._read_system()
        self._start_runs = self._count(times_scheduled)

    def _count_delta(self, read: Callable[[int], int], start: dict[str, int]) -> dict[str, int]:
        now = self._count(read)
        return {name: now[name] - start.get(name, 0) for name in now}

    def delta(self) -> dict[str, float]:
        now = self._read()
        return {name: round(now[name] - self._start.get(name, 0.0), 3) for name in now}

    def system_delta(self) -> dict[str, float]:
        """The kernel's part of ``delta()``, per group."""
        now = self._read_system()
        return {name: round(now[name] - self._start_system.get(name, 0.0), 3) for name in now}

    def wait_delta(self) -> dict[str, float]:
        """Run-queue wait per group since ``start()``, summed over threads."""
        now = self._read_wait()
        return {name: round(now[name] - self._start_wait.get(name, 0.0), 3) for name in now}

    def runs_delta(self) -> dict[str, int]:
        """Times each group's threads were put on a CPU since ``start()``."""
        return self._count_delta(times_scheduled, self._start_runs)

    def writes_delta(self) -> dict[str, int]:
        """Write system calls each group's processes made since ``start()``."""
        return self._count_delta(write_syscalls, self._start_writes)
