"""``tokenbus up`` as a service manager, run as a user runs it: each way a service
manager or a terminal stops it stops the whole stack, in order, and leaves no process
or port behind; a SIGKILLed ``up`` takes its children with it; a later ``up`` that finds
services left behind says so, and ``tokenbus down`` stops them.

The SIGHUP run also logs JSON (``TOKENBUS_LOG_FORMAT=json``, one ``up`` fewer in the
suite): every service writes one JSON object per line, and the worker's lines about a
request carry that request's tenant, ids and attempt. The worker's log also holds what
native code and libraries write straight to the stream (torch's C++ warnings, a
checkpoint loader's progress bar, prints): not log records, so not JSON; but no log
record, tokenbus's or vLLM's, is written as text."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from tokenbus import procfs
from tokenbus_cli.stack import free_port
from tokenbus_cli.stack_state import ServiceRecord, StackState

TOKENBUS = [sys.executable, "-m", "tokenbus_cli.cli"]
NOISE = ("Unable connect", "Traceback", "ERROR", "error:")
LOGGED = ("stream_job", "bridge", "billing", "alerts", "worker-0")
NOT_RECORDS = {"worker-0"}
"""Services whose log may also hold native output (see above)."""
TEXT_RECORD = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} |\([^)]*\) )?"
    r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
)
"""A log record in text: ours (``asctime levelname name``) or vLLM's (``INFO 12-01 ...``,
``(EngineCore_DP0 pid=1) INFO ...``)."""


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


def ask(env: dict[str, str], home: Path) -> str:
    """One chat completion through the stack's bridge; its request id."""
    key = (home / "dev-api-key").read_text().strip()
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{env['TOKENBUS_BRIDGE_PORT']}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        return str(response.headers["X-Request-ID"])


def assert_json_logs_name_the_request(home: Path, request_id: str) -> None:
    about_request = []
    for service in LOGGED:
        text = (home / "logs" / f"{service}.log").read_text(errors="replace")
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines, service
        for line in lines:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                assert service in NOT_RECORDS, f"{service}: not a JSON line: {line!r}"
                assert not TEXT_RECORD.match(line), f"{service}: a text record: {line!r}"
                continue
            assert {"ts", "level", "logger", "message"} <= record.keys(), (service, line)
            if record.get("request_id") == request_id:
                about_request.append(record)
    reported = [r for r in about_request if r["message"] == "reported: ok"]
    assert len(reported) == 1, about_request
    (line,) = reported
    assert line["logger"] == "workers.worker" and line["attempt"] == 0
    assert line["tenant"] and line["session_id"] and line["num_completion_tokens"] >= 1


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_the_whole_stack_in_order(
    stop_signal: signal.Signals, tmp_path: Path, model_dir: Path
) -> None:
    env = env_for(tmp_path, model_dir)
    json_logs = stop_signal is signal.SIGHUP
    if json_logs:
        env |= {"TOKENBUS_LOG_FORMAT": "json", "TOKENBUS_DEBUG_LOGGERS": '["workers.worker"]'}
    process, err = start_up(tmp_path, env)
    request_id = None
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
        if json_logs:
            request_id = ask(env, tmp_path)
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
    if request_id is not None:
        assert_json_logs_name_the_request(tmp_path, request_id)


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
