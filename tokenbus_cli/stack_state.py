"""What a running local stack writes down about itself, so that later commands find it.

``<home>/stack.json`` lists the ``tokenbus up`` process and each service: its pid and
the pid's start time (so a reused pid is never taken for it), its port and how its
health is read. ``tokenbus status`` reads it; ``tokenbus up`` refuses to start over a
stack that left live services behind, and ``tokenbus down`` stops them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenbus import procfs


@dataclass
class ServiceRecord:
    name: str
    pid: int
    started: int | None
    """The pid's start time (``procfs.start_time``) when it was recorded."""
    port: int | None = None
    health: str = "process"
    """``http`` (GET /healthz on the port), ``group`` (the job's consumer group),
    ``heartbeat`` (a worker's WorkerStatus), ``kafka`` (the broker answers), ``process``."""

    def alive(self) -> bool:
        return self.started is not None and procfs.start_time(self.pid) == self.started


@dataclass
class StackState:
    owner_pid: int
    owner_started: int | None
    bootstrap: str
    broker_profile: str
    services: list[ServiceRecord] = field(default_factory=list)

    @staticmethod
    def path(home: Path) -> Path:
        return home / "stack.json"

    @classmethod
    def load(cls, home: Path) -> StackState | None:
        try:
            raw = json.loads(cls.path(home).read_text())
            services = [ServiceRecord(**s) for s in raw.pop("services")]
            return cls(**raw, services=services)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def save(self, home: Path) -> None:
        path = self.path(home)
        temp = path.with_suffix(".tmp")
        temp.write_text(json.dumps(asdict(self), indent=1))
        temp.replace(path)

    @staticmethod
    def clear(home: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            StackState.path(home).unlink()

    def owner_alive(self) -> bool:
        return (
            self.owner_started is not None
            and procfs.start_time(self.owner_pid) == self.owner_started
        )

    def live_services(self) -> list[ServiceRecord]:
        return [s for s in self.services if s.alive()]


def stop_left_behind(home: Path, timeout_s: float = 30.0) -> list[ServiceRecord]:
    """Stops what a stack in ``home`` left running: its ``tokenbus up`` if it still
    runs (it stops its services in order), else each live service's process group, in
    reverse order of start, SIGKILL after ``timeout_s``. Returns what it stopped, in
    the order it stopped them."""
    state = StackState.load(home)
    if state is None:
        return []
    live = state.live_services()
    if state.owner_alive():
        os.kill(state.owner_pid, signal.SIGTERM)
        _wait_gone(lambda: state.owner_alive(), timeout_s)
        live = state.live_services()  # left by an owner that did not stop in time
    live.reverse()
    for service in live:
        _signal_group(service, signal.SIGTERM)
        _wait_gone(service.alive, timeout_s)
        if service.alive():
            _signal_group(service, signal.SIGKILL)
            _wait_gone(service.alive, 5)
    StackState.clear(home)
    return live


def _signal_group(service: ServiceRecord, sig: signal.Signals) -> None:
    if service.alive():  # checked again right before: never a reused pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.pid, sig)


def _wait_gone(alive: object, timeout_s: float) -> None:
    assert callable(alive)
    deadline = time.monotonic() + timeout_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
