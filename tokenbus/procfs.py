"""Processes as Linux's /proc shows them: stdlib only, so both environments import it."""

from __future__ import annotations

import os


def stat_fields(path: str) -> list[bytes]:
    """The fields of a ``/proc/<pid>/stat`` (or ``.../task/<tid>/stat``) line after the
    command name, which may hold spaces and parentheses: [0] is the state (field 3 of
    proc(5)), [1] the parent, [11] and [12] utime and stime, [16] the niceness."""
    with open(path, "rb") as stat:
        raw = stat.read()
    return raw[raw.rindex(b")") + 2 :].split()


def children(pid: int) -> list[int]:
    """Direct children of ``pid``, found by scanning /proc (no psutil in the stream env)."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(stat_fields(f"/proc/{entry}/stat")[1]) == pid:
                found.append(int(entry))
        except OSError:
            continue
    return found


def thread_ids(pid: int) -> list[int]:
    """Every thread of ``pid``; empty once it has gone."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of proc(5)); None once
    it has exited. A pid and its start time name one process, even after pid reuse."""
    try:
        fields = stat_fields(f"/proc/{pid}/stat")
        return None if fields[0] == b"Z" else int(fields[19])  # a zombie has gone too
    except (OSError, IndexError, ValueError):
        return None


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent_pid: int) -> None:
    """In a child between fork and exec (``Popen(preexec_fn=...)``): the kernel sends it
    ``sig`` when its parent dies, whatever killed the parent, SIGKILL included. If the
    parent died before this ran, the child exits at once."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
