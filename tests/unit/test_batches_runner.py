from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import batches.runner as runner_mod
from batches.metrics import RunnerMetrics
from batches.pacer_fixed import FixedPacer
from batches.runner import Runner, _Running
from schemas import encode
from schemas.batches import BatchCommand, BatchDoc
from tokenbus.batch.commands import command_key
from tokenbus.batch.store import NotFound
from tokenbus.config import Settings
from tokenbus.retry import Backoff

KEY = ("acme", "batch_0123456789")


def doc(status: str = "in_progress") -> BatchDoc:
    return BatchDoc.model_validate(
        {
            "id": KEY[1],
            "endpoint": "/v1/completions",
            "input_file_id": "file-0123456789",
            "completion_window": "24h",
            "status": status,
            "created_at": 1,
            "tenant": KEY[0],
        }
    )


class FlakyStore:
    """Raises ``error`` for the first ``num_failures`` reads, then answers ``answer``."""

    def __init__(self, num_failures: int, answer: BatchDoc, error: Exception) -> None:
        self.num_failures = num_failures
        self.answer = answer
        self.error = error
        self.num_reads = 0

    def batch(self, tenant: str, batch_id: str) -> BatchDoc:
        self.num_reads += 1
        if self.num_reads <= self.num_failures:
            raise self.error
        return self.answer


class FakeRun:
    """A ``BatchRun`` that fails its first ``fails`` runs."""

    runs: list[FakeRun] = []

    def __init__(self, settings: Settings, store: Any, doc: BatchDoc, *args: Any) -> None:
        self.doc = doc
        self.pacer = FixedPacer(1)
        self.dead_letters = None
        self.cancel_requested = False
        self.fails = 0
        self.num_runs = 0
        FakeRun.runs.append(self)

    async def run(self) -> None:
        self.num_runs += 1
        if self.num_runs <= self.fails:
            raise ConnectionError("the broker is away")

    def cancel(self) -> None:
        self.cancel_requested = True


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_mod, "RETRY_S", 0.0)
    monkeypatch.setattr(
        runner_mod, "STORE_BACKOFF", Backoff(initial_s=0.001, max_s=0.001), raising=False
    )
    monkeypatch.setattr(runner_mod, "BatchRun", FakeRun)
    FakeRun.runs = []


def runner(store: Any, tmp_path: Path) -> Runner:
    return Runner(Settings(home=tmp_path), store, RunnerMetrics(), lambda: FixedPacer(1))


async def test_a_failed_run_outlasts_a_store_outage_and_resumes(fast: None, tmp_path: Path) -> None:
    store = FlakyStore(3, doc(), OSError("the store is unreachable"))
    r = runner(store, tmp_path)
    first = FakeRun(Settings(home=tmp_path), store, doc())
    first.fails = 1
    task = asyncio.create_task(r._drive(first))  # type: ignore[arg-type]
    r._runs[KEY] = _Running(first, task, 0)  # type: ignore[arg-type]

    await asyncio.wait_for(task, timeout=5)

    assert store.num_reads == 4  # three failed reads of the document, then one that answers
    assert [run.num_runs for run in FakeRun.runs] == [1, 1]  # the batch ran again
    assert KEY not in r._runs


async def test_a_create_waits_out_a_store_outage_and_a_missing_batch_is_skipped(
    fast: None, tmp_path: Path
) -> None:
    command = BatchCommand(kind="create", tenant_id=KEY[0], batch_id=KEY[1])
    record = SimpleNamespace(value=encode(command), key=command_key(*KEY), partition=0)

    store = FlakyStore(2, doc(), OSError("the store is unreachable"))
    r = runner(store, tmp_path)
    r._producer = object()  # type: ignore[assignment]
    await r._handle(record)  # raised the store's error, which stopped the runner
    await asyncio.wait_for(r._runs[KEY].task, timeout=5)
    assert store.num_reads == 3
    assert [run.num_runs for run in FakeRun.runs] == [1]

    missing = FlakyStore(1, doc(), NotFound(KEY[1]))
    r = runner(missing, tmp_path)
    r._producer = object()  # type: ignore[assignment]
    await r._handle(record)
    assert missing.num_reads == 1  # not found is an answer: no retry
    assert KEY not in r._runs
