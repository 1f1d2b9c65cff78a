"""On a shared host the vLLM engine yields the CPU; the worker's own loop does not."""

from __future__ import annotations

from pathlib import Path

from tokenbus.config import Settings
from tokenbus.procfs import children, stat_fields, thread_ids
from tokenbus_cli.stack import Stack


def thread_niceness(pid: int) -> set[int]:
    """The niceness of every thread of ``pid`` (Linux keeps it per thread)."""
    return {int(stat_fields(f"/proc/{pid}/task/{tid}/stat")[16]) for tid in thread_ids(pid)}


def test_the_engine_core_is_niced_and_the_worker_loop_is_not(
    stack: Stack, settings: Settings
) -> None:
    assert settings.worker_nice > 0
    worker = stack.service("worker-0").process.pid
    engines = children(worker)
    assert engines, "the worker has started no engine process"
    for engine in engines:
        assert thread_niceness(engine) == {settings.worker_nice}, engine
    # The worker's loop (Kafka I/O, cancels, vLLM's output processing) keeps its own.
    assert thread_niceness(worker) == {0}
    # Its session still yields to the control plane's where sessions are scheduled.
    autogroup = Path(f"/proc/{worker}/autogroup")
    if autogroup.exists():
        assert autogroup.read_text().split()[-1] == str(settings.worker_nice)
