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
