"""``tokenbus up`` as a service manager, run as a user runs it: each way a service
manager or a terminal stops it stops the whole stack, in order, and leaves no process
or port behind; a SIGKILLed ``up`` takes its children with it; a later ``up`` that finds
services left behind says so, and ``tokenbus down`` stops them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import free_port
from tokenbus import procfs
from tokenbus_cli.stack_state import ServiceRecord, StackState

TOKENBUS = [sys.executable, "-m", "tokenbus_cli.cli"]
NOISE = ("Unable connect", "Traceback", "ERROR", "error:")


def env_for(home: Path, model_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "TOKENBUS_HOME": str(home),
        "TOKENBUS_MODEL_PATH": str(model_dir),
        "TOKENBUS_KAFKA_PORT": str(free_port()),
        "TOKENBUS_BRIDGE_PORT": str(free_port()),
        "TOKENBUS_BILLING_QUERY_PORT": str(free_port()),
        "TOKENBUS_ALERTS_PORT": str(free_port()),
        "TERM": "dumb",
    }


def start_up(home: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    err = home / "up.stderr"
    process = subprocess.Popen(
        [*TOKENBUS, "up"], env=env, stdout=subprocess.DEVNULL, stderr=err.open("wb")
    )
    deadline = time.monotonic() + 300
    while "tokenbus is up" not in err.read_text(errors="replace"):
        assert process.poll() is None, err.read_text()
        assert time.monotonic() < deadline, err.read_text()
        time.sleep(0.5)
    return process, err


def services_of(home: Path) -> list[ServiceRecord]:
    state = StackState.load(home)
    assert state is not None
    return state.services


def all_gone(services: list[ServiceRecord], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(s.alive() for s in services):
            return []
        time.sleep(0.2)
    return [f"{s.name} (pid {s.pid})" for s in services if s.alive()]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_the_whole_stack_in_order(
    stop_signal: signal.Signals, tmp_path: Path, model_dir: Path
) -> None:
    env = env_for(tmp_path, model_dir)
    process, err = start_up(tmp_path, env)
    try:
        started = err.read_text(errors="replace")
        assert not [n for n in NOISE if n in started], started  # a quiet start
        status = subprocess.run([*TOKENBUS, "status"], env=env, capture_output=True, timeout=60)
        table = status.stdout.decode()
        assert status.returncode == 0, table + status.stderr.decode()
        for name in ("broker", "billing", "stream_job", "alerts", "batches", "worker-0", "bridge"):
            assert name in table, table
        services = services_of(tmp_path)
        assert {s.name for s in services} == {
            "broker",
            "billing",
            "stream_job",
            "alerts",
            "batches",
            "worker-0",
            "bridge",
        }
        process.send_signal(stop_signal)
        assert process.wait(timeout=60) == 0, err.read_text()
        assert all_gone(services, timeout_s=1) == []
        assert port_free(int(env["TOKENBUS_KAFKA_PORT"]))
        assert port_free(int(env["TOKENBUS_BRIDGE_PORT"]))
        assert StackState.load(tmp_path) is None
        assert "stopped." in err.read_text()
    finally:
        process.kill()
        process.wait()


def test_a_killed_up_takes_its_services_with_it(tmp_path: Path, model_dir: Path) -> None:
    env = env_for(tmp_path, model_dir)
    process, _ = start_up(tmp_path, env)
    services = services_of(tmp_path)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert all_gone(services, timeout_s=45) == []
    assert port_free(int(env["TOKENBUS_KAFKA_PORT"]))
    # What is written down names only dead processes: the next `up` starts cleanly.
    state = StackState.load(tmp_path)
    assert state is not None and not state.live_services()


def test_up_over_services_left_behind_says_so_and_down_stops_them(
    tmp_path: Path, model_dir: Path
) -> None:
    env = env_for(tmp_path, model_dir)
    orphan = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        # As a stack whose `up` died without its children's parent-death signal left it.
        StackState(
            owner_pid=orphan.pid + 1_000_000,
            owner_started=None,
            bootstrap=f"127.0.0.1:{env['TOKENBUS_KAFKA_PORT']}",
            broker_profile="tansu",
            services=[ServiceRecord("broker", orphan.pid, procfs.start_time(orphan.pid))],
        ).save(tmp_path)
        up = subprocess.run(
            [*TOKENBUS, "up"], env=env, capture_output=True, stdin=subprocess.DEVNULL, timeout=60
        )
        said = up.stderr.decode()
        assert up.returncode == 1, said
        assert "left services running: broker" in said and "tokenbus down" in said, said
        assert orphan.poll() is None  # asked, not stopped behind the user's back
        down = subprocess.run([*TOKENBUS, "down"], env=env, capture_output=True, timeout=60)
        assert down.returncode == 0
        assert f"stopped broker (pid {orphan.pid})" in down.stdout.decode()
        assert orphan.wait(timeout=10) == -signal.SIGTERM
        assert StackState.load(tmp_path) is None
    finally:
        orphan.kill()
        orphan.wait()
