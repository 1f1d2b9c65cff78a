"""The local stack as a service manager: children die with the process that started
them (even by SIGKILL), services stop in reverse order of start, and what a dead stack
left behind is found and stopped (tokenbus_cli.stack, tokenbus_cli.stack_state)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tokenbus import procfs
from tokenbus.config import Settings
from tokenbus_cli.stack import (
    LISTEN_PORTS_FROM,
    Service,
    Stack,
    StackError,
    StackLeftBehind,
    free_port,
    make_home,
    settings_env,
    stop_services,
)
from tokenbus_cli.stack_state import ServiceRecord, StackState, stop_left_behind


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = procfs.start_time(pid) and procfs.stat_fields(f"/proc/{pid}/stat")[0]
        if state in (None, b"Z"):
            return True
        time.sleep(0.05)
    return False


def test_a_child_gets_sigterm_when_its_parent_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import os, subprocess, time
                from tokenbus_cli.stack import _dies_with
                child = subprocess.Popen(
                    ["sleep", "600"], start_new_session=True, preexec_fn=_dies_with(os.getpid())
                )
                open({str(pid_file)!r}, "w").write(str(child.pid))
                time.sleep(600)
                """
            ),
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert not gone(child, timeout_s=0.2)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert gone(child), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()


def service(tmp_path: Path, name: str, log: Path) -> Service:
    """A process that notes its SIGTERM in ``log`` and then takes 0.3 s to exit."""
    code = textwrap.dedent(
        f"""
        import signal, sys, time
        def stop(*_):
            open({str(log)!r}, "a").write({name!r} + "\\n")
            time.sleep(0.3)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("up", flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"up\n"
    return Service(name, process, tmp_path / f"{name}.log")


def test_services_stop_in_reverse_order_of_start_one_kind_at_a_time(tmp_path: Path) -> None:
    log = tmp_path / "stopped"
    names = ["broker", "billing", "stream_job", "worker-0", "worker-1", "bridge"]
    services = [service(tmp_path, name, log) for name in names]
    stop_services(services, timeout_s=20)
    order = log.read_text().split()
    assert order[0] == "bridge"
    assert set(order[1:3]) == {"worker-0", "worker-1"}  # together: a wave of one kind
    assert order[3:] == ["stream_job", "billing", "broker"]
    assert services == []


def test_a_record_never_takes_a_reused_pid_for_its_service() -> None:
    me = os.getpid()
    assert ServiceRecord("x", me, procfs.start_time(me)).alive()
    assert not ServiceRecord("x", me, (procfs.start_time(me) or 0) + 1).alive()
    assert not ServiceRecord("x", me, None).alive()


def test_down_stops_what_a_dead_stack_left_behind(tmp_path: Path) -> None:
    orphans = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(2)]
    try:
        StackState(
            owner_pid=999_999_999,  # no such process: `tokenbus up` died
            owner_started=1,
            bootstrap="127.0.0.1:1",
            broker_profile="tansu",
            services=[
                ServiceRecord(f"s{n}", p.pid, procfs.start_time(p.pid))
                for n, p in enumerate(orphans)
            ],
        ).save(tmp_path)
        state = StackState.load(tmp_path)
        assert state is not None and not state.owner_alive()
        assert len(state.live_services()) == 2
        stopped = stop_left_behind(tmp_path, timeout_s=5)
        assert [s.name for s in stopped] == ["s1", "s0"]  # reverse order of start
        for process in orphans:
            assert process.wait(timeout=5) == -signal.SIGTERM
        assert StackState.load(tmp_path) is None
    finally:
        for process in orphans:
            process.kill()
            process.wait()


def test_each_job_instance_has_a_faust_data_directory_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = Stack(Settings(home=tmp_path))
    spawned: dict[str, dict[str, Any]] = {}

    def spawn_http(name: str, argv: list[str], port_field: str, **overrides: Any) -> None:
        spawned[name] = overrides

    monkeypatch.setattr(stack, "spawn_http", spawn_http)
    stack.add_job("stream_job-1")
    datadir = spawned["stream_job-1"]["faust_datadir"]
    assert datadir == tmp_path / "faust-stream_job-1" != stack.settings.faust_dir
    env = settings_env(stack.settings, faust_datadir=datadir)
    from_env = Path(env["TOKENBUS_FAUST_DATADIR"])
    assert Settings(home=tmp_path, faust_datadir=from_env).faust_dir == datadir
    assert Settings(home=tmp_path).faust_dir == tmp_path / "faust"


def test_the_bundled_broker_is_reached_on_its_host() -> None:
    assert Settings(kafka_port=9).bootstrap == "127.0.0.1:9"
    assert Settings(kafka_host="10.0.0.1", kafka_port=9).bootstrap == "10.0.0.1:9"


def test_a_refused_start_leaves_the_earlier_stacks_record_for_down(tmp_path: Path) -> None:
    orphan = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        record = ServiceRecord("broker", orphan.pid, procfs.start_time(orphan.pid))
        StackState(orphan.pid + 1_000_000, None, "127.0.0.1:9", "tansu", [record]).save(tmp_path)
        with pytest.raises(StackLeftBehind):
            asyncio.run(Stack(Settings(home=tmp_path)).start())
        state = StackState.load(tmp_path)
        assert state is not None and state.live_services() == [record]
    finally:
        orphan.kill()
        orphan.wait()


def test_the_stack_s_home_is_made_the_operator_s_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    new, chosen = tmp_path / "a" / "home", tmp_path / "chosen"
    chosen.mkdir()
    chosen.chmod(0o755)  # a directory the operator keeps more in: told, not changed
    make_home(new)
    make_home(chosen)
    assert stat.S_IMODE(new.stat().st_mode) == 0o700
    assert stat.S_IMODE(chosen.stat().st_mode) == 0o755
    assert [r.getMessage() for r in caplog.records] == [
        f"{chosen} (TOKENBUS_HOME) can be read by other users, and holds prompts, usage and "
        f"tables: chmod 700 {chosen}"
    ]


def test_free_ports_are_below_the_range_outgoing_connections_are_given(tmp_path: Path) -> None:
    """A service binds its port some time after the stack picks it (a worker after its
    engine loads): a port from the ephemeral range could meanwhile be the local port of
    any outgoing connection."""
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert all(LISTEN_PORTS_FROM <= port < low for port in ports), (low, high, ports)
    for port in ports:  # each one free when handed out
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def _unpromised_ports(num: int) -> list[int]:
    """Distinct free ports that ``free_port`` has not handed out (the kernel's choice)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(num)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def test_a_port_not_yet_bound_is_never_handed_out_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen in CI: the billing query server and the alerts service were both given port
    25993 (two picks of the test's environment, neither bound yet), and billing failed
    to start with "address already in use". Here the draw repeats itself, as a
    one-in-12,000 chance did there."""
    first, (other,) = free_port(), _unpromised_ports(1)
    monkeypatch.setattr(random, "sample", lambda *_: [first, other])
    assert free_port() == other  # ``first`` is still free, and promised
    with pytest.raises(StackError, match="handed out"):
        free_port()


def test_a_stack_picks_none_of_the_ports_its_settings_promised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ports in a stack's settings may come from another process (the caller's
    environment) and are bound only as each service starts: the stack's own picks skip
    them."""
    promised, other = _unpromised_ports(2)
    settings = Settings(home=tmp_path, billing_query_port=promised)
    monkeypatch.setattr(random, "sample", lambda *_: [promised, other])
    assert Stack(settings).free_port() == other


def test_a_service_that_failed_to_start_shows_its_error_not_native_exit_noise(
    tmp_path: Path,
) -> None:
    """Seen in CI: the worker's tail was triton's nanobind leak report, 30 lines of it,
    and the error above it was not shown."""
    log_path = tmp_path / "worker-0.log"
    noise = "\n".join(
        [
            *(
                f' - leaked instance 0x{n:x} of type "triton._C.libtriton.ir.attribute"'
                for n in range(40)
            ),
            "nanobind: leaked 64 types!",
            " - ... skipped remainder",
            "nanobind: this is likely caused by a reference counting issue in the binding code.",
            "See https://nanobind.readthedocs.io/en/latest/refleaks.html",
        ]
    )
    script = (
        "import sys\n"
        "print('Traceback (most recent call last):')\n"
        "print('OSError: [Errno 98] error while attempting to bind: address already in use')\n"
        f"sys.stderr.write({noise!r} + '\\n')\n"
        "sys.exit(1)\n"
    )
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", script], stdout=log_file, stderr=subprocess.STDOUT
        )
    process.wait(timeout=30)
    with pytest.raises(StackError) as refused:
        Service("worker-0", process, log_path).check_alive()
    message = str(refused.value)
    assert "worker-0 exited with code 1" in message
    assert "address already in use" in message
    assert "leaked" not in message and "nanobind" not in message


def test_the_bundled_broker_runs_the_threads_its_setting_names(tmp_path: Path) -> None:
    """tansu's runtime takes its size from TOKIO_WORKER_THREADS (one per core without it;
    its blocking pool's threads bear the same name, so the environment is what is read)."""
    settings = Settings(
        home=tmp_path, kafka_port=free_port(), broker_profile="tansu", kafka_broker_threads=3
    )
    stack = Stack(settings)
    try:
        asyncio.run(stack.start_broker())
        environ = Path(f"/proc/{stack.pid('broker')}/environ").read_bytes().split(b"\0")
        assert b"TOKIO_WORKER_THREADS=3" in environ
    finally:
        stack.stop()
    assert Settings().kafka_broker_threads == 1
