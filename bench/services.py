"""The services a stage benchmark needs, started by the product's own supervisor.

A benchmark builds a ``tokenbus_cli.stack.Stack`` on its settings and starts only what
it measures (``Stack.start_broker``, then the functions here), each service as ``tokenbus
up`` starts it, and ready by its health; ``Stack.stop`` stops them in reverse order.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import AsyncIterator

from tokenbus.config import Settings
from tokenbus_cli.stack import Stack


async def start_job(stack: Stack) -> None:
    """The Faust job as ``stream_job`` (a web port and data directory of its own), ready
    when its ``/healthz`` says it holds its partitions."""
    await stack.wait_ready(stack.add_job("stream_job"), 120)


async def start_billing(stack: Stack) -> None:
    """The billing sink and its query server, ready when its ``/healthz`` answers."""
    await stack.wait_ready(stack.add_billing(), 60)


async def start_bridge(stack: Stack) -> None:
    """The SSE bridge on ``Settings.bridge_port``, ready when its ``/healthz`` answers."""
    bridge = stack.spawn_http("bridge", [sys.executable, "-m", "bridge"], "bridge_port")
    await stack.wait_ready(bridge, 60)


async def start_fake_worker(
    stack: Stack,
    worker_id: str,
    *,
    step_ms: float = 0.0,
    tokens_per_step: int = 1,
    prefill_ms_per_1k: float = 0.0,
) -> None:
    """The real worker loop on the pretend engine (``bench.fake_worker``), ready when its
    heartbeat is on the bus."""
    env = {
        "BENCH_STEP_MS": str(step_ms),
        "BENCH_TOKENS_PER_STEP": str(tokens_per_step),
        "BENCH_PREFILL_MS_PER_1K": str(prefill_ms_per_1k),
    }
    argv = [sys.executable, "-m", "bench.fake_worker"]
    worker = stack.spawn(worker_id, argv, env_extra=env, worker_id=worker_id)
    worker.health = "heartbeat"
    await stack.wait_ready(worker, 60)


@contextlib.asynccontextmanager
async def broker_only(
    settings: Settings, topics: dict[str, int] | None = None
) -> AsyncIterator[Stack]:
    """A broker alone, for the benchmarks of a Kafka hop; stopped, and its home removed."""
    stack = Stack(settings)
    try:
        await stack.start_broker(topics)
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(settings.home, ignore_errors=True)
