"""Exactly once, on real processes: SIGKILL the sink mid-batch, restart it, replay the topic.

Each sink here is a real ``python -m billing`` child process on its own chdb directory
and topic prefix, against this module's own tansu broker, so the session stack and the
other tests are left alone. The first sink runs with a store that freezes right after
ClickHouse acknowledged an insert and before the offsets are committed: the narrowest
spot for exactly-once, and the test kills it there. The second, resuming from the
first's commits, is frozen and killed the same way two inserts later. After a clean
run to the end, the group's offsets go back to the start and a last sink reads the
whole topic again.

Run as a script (``python -m tests.integration.test_billing_exactly_once N MARKER``),
this module is that freezing sink.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from bench.billing_sink import produce_usage
from billing.reader import open_reader
from billing.sink import billing_group_id
from schemas import FinishReason, UsageEvent, UsageStatus, encode
from tests.integration.test_billing_sink import _committed, _health, bootstrap
from tokenbus.config import Settings
from tokenbus.cost import PeakHours
from tokenbus.kafka import ensure_topics, wait_for_broker
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer
from tokenbus.topics import Topics
from tokenbus_cli.stack import REPO_ROOT, free_port, settings_env

pytestmark = pytest.mark.integration
__all__ = ["bootstrap"]  # the module's tansu broker, shared with test_billing_sink

NUM_PARTITIONS = 3
NUM_EVENTS = 12_000
NUM_COPIES = 600
"""Events produced a second time, later in the topic: a producer retry, a re-served request."""
NUM_RERUNS = 300
"""Requests run to the end a second time, as another attempt, last in the topic (a worker
presumed lost that finished anyway): stored with their cost, billed nothing."""
FREEZE_AT_INSERT = 3
TIMEOUT_S = 120.0
PEAK = PeakHours.parse("9-17")


def _events(rng: random.Random) -> list[UsageEvent]:
    t0 = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)
    statuses = [UsageStatus.OK] * 14 + [UsageStatus.FAILED, UsageStatus.CANCELLED]
    events = []
    for n in range(NUM_EVENTS):
        status = rng.choice(statuses)
        long_context = rng.random() < 0.2
        events.append(
            UsageEvent(
                request_id=f"req_{n:06d}",
                session_id=f"sess_{n % 700}",
                tenant_id=f"tenant-{n % 41}",
                model=rng.choice(["tiny-llama", "other-model"]),
                worker_id=f"worker-{n % 3}",
                priority=n % 3,
                attempt=rng.choice([0, 0, 0, 1]),
                status=status,
                finish_reason=FinishReason.ERROR if status is UsageStatus.FAILED else None,
                num_prompt_tokens=rng.randint(8192, 14000)
                if long_context
                else rng.randint(1, 2000),
                num_completion_tokens=rng.randint(0, 400),
                num_cached_tokens=rng.randint(0, 64),
                ttft_ms=rng.uniform(1, 300),
                total_ms=rng.uniform(300, 3000),
                precision=rng.choice(["fp16", "int8"]),
                created_at=t0 + timedelta(seconds=n),
                finished_at=t0 + timedelta(seconds=n + 2),
            )
        )
    return events


@pytest.fixture
async def settings(bootstrap: str, tmp_path: Path) -> Settings:
    settings = Settings(
        home=tmp_path,
        kafka_bootstrap=bootstrap,
        broker_profile="tansu",
        topic_prefix=f"once-{uuid.uuid4().hex[:8]}",
        num_partitions=NUM_PARTITIONS,
        clickhouse_dsn=f"chdb://{tmp_path / 'clickhouse'}",
        billing_query_port=free_port(),
        billing_batch_rows=1_000,
        billing_batch_max_rows=1_000,  # many batches, so a kill lands inside the stream
        billing_batch_interval_s=0.2,
        peak_hours="9-17",
        faust_session_timeout_s=1.5,
        faust_rebalance_timeout_s=1.5,
        faust_heartbeat_interval_s=0.3,
    )
    await wait_for_broker(settings, timeout_s=30)
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings, {topics.usage: NUM_PARTITIONS, topics.dead_letters: 1})
    return settings


class Sink:
    """One ``python -m billing`` process (or the freezing variant), killed by its pid."""

    def __init__(self, settings: Settings, argv: list[str], log_path: Path) -> None:
        self.settings = settings
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, *argv],
                env=settings_env(settings),
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.log_path = log_path

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=60)

    def alive(self) -> bool:
        return self.process.poll() is None

    async def health(self) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            health = await _health(self.settings)
            if health is not None:
                return health
            assert self.alive(), f"the sink died; log {self.log_path}"
            assert time.monotonic() < deadline, "the sink's query server never answered"
            await asyncio.sleep(0.1)


async def _until(condition: Any, what: str, sink: Sink) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        result = await condition()
        if result:
            return result
        assert sink.alive(), f"the sink died waiting for {what}; log {sink.log_path}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _reset_offsets(settings: Settings, partitions: list[int]) -> None:
    """Moves the sink's group back to the start of the topic, as an operator would."""
    usage = Topics(settings.topic_prefix).usage
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap,
        group_id=billing_group_id(settings),
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        tps = [TopicPartition(usage, p) for p in partitions]
        consumer.assign(tps)
        await consumer.commit({tp: 0 for tp in tps})
    finally:
        await consumer.stop()


def _count_directly(settings: Settings) -> int:
    """Rows in the chdb directory, read by this process while no sink holds it."""
    reader = open_reader(settings)
    try:
        [row] = reader.query("SELECT count() AS n FROM usage_events")
        return int(row["n"])
    finally:
        reader.close()


def _expected(events: list[UsageEvent], reruns: list[UsageEvent], pricer: Pricer) -> dict[str, Any]:
    """Every row's tokens and cost; only ``events`` billed, ``reruns`` superseded."""
    charges = [pricer.charge(e) for e in events]
    rows = [*events, *reruns]
    return {
        "num_attempts": len(rows),
        "prompt_tokens": sum(e.num_prompt_tokens for e in rows),
        "completion_tokens": sum(e.num_completion_tokens for e in rows),
        "cached_tokens": sum(e.num_cached_tokens for e in rows),
        "cost_units": sum((pricer.charge(e).cost_units for e in rows), Decimal(0)),
        "billed_units": sum((c.billed_units for c in charges), Decimal(0)),
    }


_SUMS = (
    "count() AS num_attempts, sum(prompt_tokens) AS prompt_tokens,"
    " sum(completion_tokens) AS completion_tokens, sum(cached_tokens) AS cached_tokens,"
    " sum(cost_units) AS cost_units, sum(billed_units) AS billed_units"
)
_OUTER = ", ".join(
    f"sum({name}) AS {name}"
    for name in (
        "num_attempts",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "cost_units",
        "billed_units",
    )
)
# No FINAL anywhere: the table itself must hold each attempt once. The rollup reads fail
# unless ClickHouse answers them from the projections (the materialized rollups).
TOTALS_SQL = {
    "usage_events": f"SELECT {_SUMS} FROM usage_events",
    "rollup by minute": f"SELECT {_OUTER} FROM (SELECT {_SUMS} FROM usage_events GROUP BY"
    " tenant_id, model, toStartOfMinute(created_at), status)"
    " SETTINGS force_optimize_projection = 1",
    "rollup by session": f"SELECT {_OUTER} FROM (SELECT {_SUMS} FROM usage_events GROUP BY"
    " tenant_id, session_id) SETTINGS force_optimize_projection = 1",
}


def _stored_totals(settings: Settings) -> tuple[dict[str, dict[str, Any]], int]:
    """Totals per reading, and the number of distinct attempt keys, read directly."""
    reader = open_reader(settings)
    try:
        totals = {}
        for name, sql in TOTALS_SQL.items():
            [row] = reader.query(sql)
            totals[name] = {
                key: Decimal(value) if key.endswith("_units") else int(value)
                for key, value in row.items()
            }
        [keys] = reader.query(
            "SELECT uniqExact(tenant_id, session_id, request_id, attempt) AS n FROM usage_events"
        )
        return totals, int(keys["n"])
    finally:
        reader.close()


def _superseded(settings: Settings) -> set[tuple[str, str, int]]:
    reader = open_reader(settings)
    try:
        rows = reader.query(
            "SELECT tenant_id, request_id, attempt FROM usage_events"
            " WHERE has(flags, 'superseded') AND billed_units = 0"
        )
        return {(r["tenant_id"], r["request_id"], int(r["attempt"])) for r in rows}
    finally:
        reader.close()


async def test_killed_mid_batch_restarted_and_replayed_the_totals_stay_exact(
    settings: Settings, tmp_path: Path
) -> None:
    rng = random.Random(6)
    events = _events(rng)
    copies = rng.sample(events, NUM_COPIES)
    rerun = rng.sample(events, NUM_RERUNS)
    reruns = [e.model_copy(update={"attempt": 1 - e.attempt}) for e in rerun]
    records = [(e.tenant_id.encode(), encode(e)) for e in [*events, *copies, *reruns]]
    ends = await produce_usage(settings, records, linger_ms=5, max_batch_size=256 * 1024)
    num_records = sum(ends.values())
    assert num_records == NUM_EVENTS + NUM_COPIES + NUM_RERUNS
    log_path = tmp_path / "sinks.log"

    # 1. Frozen after ClickHouse acknowledged its 3rd insert, before that commit: kill.
    marker = tmp_path / "frozen"
    first = Sink(
        settings,
        ["-m", "tests.integration.test_billing_exactly_once", str(FREEZE_AT_INSERT), str(marker)],
        log_path,
    )
    try:
        await _until(lambda: asyncio.to_thread(marker.exists), "the frozen insert", first)
        frozen = await first.health()
        committed = await _committed(settings, ends)
    finally:
        first.kill()
    # Two batches done and committed; the third is in ClickHouse but not committed. (The
    # copies come last in the topic, so these early batches hold only first copies.)
    num_stored = await asyncio.to_thread(_count_directly, settings)
    assert frozen["num_batches"] == FREEZE_AT_INSERT - 1
    assert sum(offset or 0 for offset in committed.values()) == frozen["num_inserted"]
    assert num_stored > frozen["num_inserted"]

    # 2. A restarted sink, killed mid-batch again: after its 2nd insert, before that
    # commit. (Killed at a time instead, a fast machine let it reach the copies first.)
    marker = tmp_path / "frozen-again"
    second = Sink(
        settings, ["-m", "tests.integration.test_billing_exactly_once", "2", str(marker)], log_path
    )
    try:
        await _until(lambda: asyncio.to_thread(marker.exists), "the second frozen insert", second)
        assert (await second.health())["num_inserted"] > 0  # its first batch is committed
    finally:
        second.kill()

    # 3. A plain sink to the end.
    third = Sink(settings, ["-m", "billing"], log_path)
    try:

        async def caught_up() -> bool:
            return await _committed(settings, ends) == ends

        await _until(caught_up, "the third sink to commit everything", third)
        third_health = await third.health()
    finally:
        third.terminate()
    assert third_health["num_duplicates"] >= NUM_COPIES

    # 4. Replay the whole topic from offset 0.
    await _reset_offsets(settings, sorted(ends))
    assert set((await _committed(settings, ends)).values()) == {0}
    fourth = Sink(settings, ["-m", "billing"], log_path)
    try:
        await _until(caught_up, "the replay to commit everything", fourth)
        replay = await fourth.health()
    finally:
        fourth.terminate()
    totals, num_keys = await asyncio.to_thread(_stored_totals, settings)
    superseded = await asyncio.to_thread(_superseded, settings)

    assert (replay["num_inserted"], replay["num_duplicates"]) == (0, num_records)
    # Exactly the UsageEvents, each attempt once: the first copy of every key.
    distinct = list(
        {(e.tenant_id, e.session_id, e.request_id, e.attempt): e for e in events}.values()
    )
    expected = _expected(distinct, reruns, Pricer(read_price_book(BUNDLED_PRICES), PEAK))
    assert num_keys == len(distinct) + NUM_RERUNS == totals["usage_events"]["num_attempts"]
    for reading, got in totals.items():
        assert got == expected, reading
    # Each request billed for one run: the run reported second is the one superseded.
    assert superseded == {(e.tenant_id, e.request_id, e.attempt) for e in reruns}


def _freeze_after_insert(num_inserts: int, marker: Path) -> None:
    """Runs ``python -m billing`` with a store that stops dead after insert ``num_inserts``."""
    from billing import __main__ as billing_main
    from billing.storage import ClickHouseStore

    original = ClickHouseStore.insert_columns
    calls = [0]

    def insert_columns(self: ClickHouseStore, columns: Any, *, dedup_token: str) -> None:
        original(self, columns, dedup_token=dedup_token)
        calls[0] += 1
        if calls[0] == num_inserts:
            marker.touch()
            threading.Event().wait()  # acknowledged, never returns: no commit follows

    ClickHouseStore.insert_columns = insert_columns  # type: ignore[method-assign]
    billing_main.main()


if __name__ == "__main__":
    _freeze_after_insert(int(sys.argv[1]), Path(sys.argv[2]))


@pytest.mark.parametrize(("copy_skew_s", "num_rows"), [(600.0, 1), (0.0, 2)])
async def test_a_request_run_twice_after_a_job_crash_is_billed_once_across_a_sink_restart(
    settings: Settings, tmp_path: Path, copy_skew_s: float, num_rows: int
) -> None:
    # A Faust job killed before its ledger entry reached the changelog admits the request
    # again, under the same key, created at its second admission (4 minutes later here).
    # Meanwhile the sink restarted, and reads back only the last 60 s of attempts: the
    # first copy is older than its index. With no skew allowed, it is billed twice.
    settings = settings.model_copy(
        update={"billing_recent_window_s": 60.0, "billing_copy_skew_s": copy_skew_s}
    )
    now = datetime.now(UTC).replace(microsecond=0)
    first = UsageEvent(
        request_id="run-twice",
        session_id="s",
        tenant_id="tenant-0",
        model="tiny",
        status=UsageStatus.OK,
        finish_reason=FinishReason.STOP,
        num_prompt_tokens=10,
        num_completion_tokens=5,
        created_at=now - timedelta(minutes=5),
        finished_at=now - timedelta(minutes=5),
    )
    newest = first.model_copy(update={"request_id": "another", "created_at": now})
    again = first.model_copy(update={"created_at": now - timedelta(minutes=1)})
    log_path = tmp_path / "sinks.log"
    for batch in ([first, newest], [again]):
        ends = await produce_usage(settings, [(e.tenant_id.encode(), encode(e)) for e in batch])
        sink = Sink(settings, ["-m", "billing"], log_path)
        try:
            await _until(functools.partial(_commits_reach, settings, ends), "the commits", sink)
        finally:
            sink.terminate()

    def rows() -> int:
        reader = open_reader(settings)
        try:
            [row] = reader.query(
                "SELECT count() AS n FROM usage_events WHERE request_id = 'run-twice'"
            )
            return int(row["n"])
        finally:
            reader.close()

    assert await asyncio.to_thread(rows) == num_rows


async def _commits_reach(settings: Settings, ends: dict[int, int]) -> bool:
    committed = await _committed(settings, ends)
    return all((committed.get(p) or 0) >= end for p, end in ends.items())
