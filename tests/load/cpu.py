"""CPU the stack's services use, as /proc counts it: each service with every process
under it (a vLLM worker's engine core is a child of the worker). The chaos matrix's
abuse row samples it to say where the abuse's cost lands; contention from other
programs disturbs these figures less than it disturbs latencies.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tokenbus import procfs

Snapshot = tuple[float, dict[str, float]]
"""(monotonic time, CPU seconds so far of each named process tree)."""


def tree_cpu_s(roots: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) of each named root pid and all its descendants but
    the other roots' trees (so this process's tree is its own and its helpers', without
    the services it started), from one pass over /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    own: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = procfs.stat_fields(f"/proc/{entry}/stat")
        except OSError:
            continue
        pid = int(entry)
        parent[pid] = int(fields[1])
        own[pid] = (int(fields[11]) + int(fields[12])) / tick
    others = set(roots.values())
    return {
        name: sum(own[p] for p in subtree(parent, root, others - {root}))
        for name, root in roots.items()
    }


def subtree(parent: Mapping[int, int], root: int, stop: set[int] | None = None) -> list[int]:
    """``root`` and every pid below it, given each pid's parent, except the pids in
    ``stop`` and what is below them; empty if ``root`` is gone."""
    if root not in parent:
        return []
    below: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        below.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if stop and pid in stop:
            continue
        found.append(pid)
        todo += below.get(pid, [])
    return found


def cores(snapshots: Sequence[Snapshot], since: float, until: float) -> dict[str, float]:
    """Cores each tree used between two monotonic times: the CPU seconds between the
    snapshots nearest inside the span, over the time between them. A tree that
    restarted (its count fell) or is missing at either end is left out."""
    inside = [s for s in snapshots if since <= s[0] <= until]
    if len(inside) < 2:
        return {}
    (t0, first), (t1, last) = inside[0], inside[-1]
    if t1 <= t0:
        return {}
    return {
        name: (last[name] - first[name]) / (t1 - t0)
        for name in first
        if name in last and last[name] >= first[name]
    }


@dataclass
class CpuSampler:
    """Snapshots of the named trees every ``every_s``, from a thread (the event loop it
    runs on carries the measured clients)."""

    roots: dict[str, int]
    every_s: float = 2.0
    snapshots: list[Snapshot] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            taken = await asyncio.to_thread(tree_cpu_s, dict(self.roots))
            self.snapshots.append((time.monotonic(), taken))
            await asyncio.sleep(self.every_s)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
