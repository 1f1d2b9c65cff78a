"""stream_jobs.changelog: a table's changelog records go straight to aiokafka, in the
order they were written, and Faust's flush before a commit waits for every one of them.

The producer here stands for aiokafka's (its ``send`` appends to a list and returns the
future of the broker's acknowledgement); the tables are real Faust tables of an app that
is not started."""

from __future__ import annotations

import asyncio
import logging
import weakref
from types import SimpleNamespace
from typing import Any, cast

import faust
import pytest
from aiokafka.structs import RecordMetadata, TopicPartition
from faust.streams import _current_event

from stream_jobs.changelog import DirectChangelog, direct_table
from stream_jobs.dispatcher import DispatchMetrics
from stream_jobs.metrics import job_registry


class Broker:
    """aiokafka's producer as the changelog path uses it: ``send`` appends the record
    (waiting first at ``gate``, when set, as aiokafka waits for a full batch to drain)
    and returns the future of its acknowledgement, settled by ``ack``."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, bytes, bytes | None]] = []
        self.acks: list[asyncio.Future[Any]] = []
        self.gate: asyncio.Event | None = None
        self.refuse: set[bytes] = set()

    async def send(
        self, topic: str, value: bytes | None, *, key: bytes, partition: int
    ) -> asyncio.Future[Any]:
        if self.gate is not None:
            await self.gate.wait()
        if key in self.refuse:
            raise RuntimeError(f"refused {key!r}")
        self.records.append((topic, partition, key, value))
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.acks.append(ack)
        return ack

    def ack(self) -> None:
        """Acknowledges every record appended so far, at its place in the list."""
        for offset, (ack, (topic, partition, _, _)) in enumerate(
            zip(self.acks, self.records, strict=True)
        ):
            if not ack.done():
                ack.set_result(
                    RecordMetadata(
                        topic, partition, TopicPartition(topic, partition), offset, -1, 0, -1
                    )
                )


class Event:
    """What a table asks of the current event: its message's topic and partition."""

    def __init__(self, message: Any) -> None:
        self.message = message


class FaustProducer:
    """The app's Faust producer: a running aiokafka producer under it, and its flush."""

    def __init__(self, broker: Broker) -> None:
        self._producer = broker
        self.flushes = 0

    def _ensure_producer(self) -> Broker:
        return self._producer

    async def flush(self) -> None:
        self.flushes += 1


def app_over(broker: Broker) -> tuple[faust.App, FaustProducer]:
    app = faust.App(
        "changelog-test", broker="kafka://127.0.0.1:1", key_serializer="raw", value_serializer="raw"
    )
    producer = FaustProducer(broker)
    app.producer = producer  # type: ignore[assignment]
    return app, producer


async def test_records_reach_aiokafka_in_the_order_tables_were_written() -> None:
    broker = Broker()
    app, _ = app_over(broker)
    changelog = DirectChangelog(app)
    ledger = direct_table(app, changelog, "ledger", 4)
    spend = direct_table(app, changelog, "spend", 4)
    futures = [
        ledger.send_changelog(2, b"acme/r1", b"admitted"),
        spend.send_changelog(2, b"acme/b", b"[1,0]"),
        ledger.send_changelog(2, b"acme/r1", b"forwarded"),
        ledger.send_changelog(3, b"globex/r9", None),  # a tombstone
    ]
    await changelog.flush()
    assert broker.records == [
        ("changelog-test-ledger-changelog", 2, b"acme/r1", b"admitted"),
        ("changelog-test-spend-changelog", 2, b"acme/b", b"[1,0]"),
        ("changelog-test-ledger-changelog", 2, b"acme/r1", b"forwarded"),
        ("changelog-test-ledger-changelog", 3, b"globex/r9", None),
    ]
    # Each future is the broker's acknowledgement, once it comes.
    assert not any(f.done() for f in futures)
    broker.ack()
    sent = await asyncio.wait_for(asyncio.gather(*futures), 1)
    assert [(s.topic, s.partition, s.offset) for s in sent] == [
        ("changelog-test-ledger-changelog", 2, 0),
        ("changelog-test-spend-changelog", 2, 1),
        ("changelog-test-ledger-changelog", 2, 2),
        ("changelog-test-ledger-changelog", 3, 3),
    ]
    assert changelog.num_sent == 4 and changelog.num_failed == 0


async def test_the_flush_before_a_commit_waits_for_every_record_queued() -> None:
    broker = Broker()
    app, producer = app_over(broker)
    changelog = DirectChangelog(app)
    table = direct_table(app, changelog, "ledger", 4)
    broker.gate = asyncio.Event()  # aiokafka's batch is full: its send waits
    for n in range(5):
        table.send_changelog(n % 4, f"t/r{n}".encode(), b"x")
    # Faust's consumer awaits app.producer.flush() before it commits an offset.
    flush = asyncio.create_task(app.producer.flush())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not flush.done() and broker.records == [] and producer.flushes == 0
    broker.gate.set()
    await asyncio.wait_for(flush, 1)
    assert [key for _, _, key, _ in broker.records] == [f"t/r{n}".encode() for n in range(5)]
    assert producer.flushes == 1  # and then Faust's own flush, which waits for the acks


async def test_a_record_aiokafka_refuses_fails_its_future_and_the_rest_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = Broker()
    broker.refuse = {b"t/bad"}
    app, _ = app_over(broker)
    changelog = DirectChangelog(app)
    table = direct_table(app, changelog, "ledger", 4)
    bad = table.send_changelog(0, b"t/bad", b"x")
    good = table.send_changelog(0, b"t/good", b"y")
    await changelog.flush()
    broker.ack()
    with pytest.raises(RuntimeError, match="refused"):
        await asyncio.wait_for(bad, 1)
    assert (await asyncio.wait_for(good, 1)).offset == 0
    assert changelog.num_failed == 1
    assert any("did not reach the broker" in r.getMessage() for r in caplog.records)


async def test_an_acknowledgement_that_fails_fails_the_records_future(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = Broker()
    app, _ = app_over(broker)
    changelog = DirectChangelog(app)
    table = direct_table(app, changelog, "ledger", 4)
    with caplog.at_level(logging.ERROR, logger="stream_jobs.changelog"):
        unawaited = table.send_changelog(1, b"t/a", b"x")  # as put_at's: nobody awaits it
        awaited = table.send_changelog(1, b"t/b", b"x")
        await changelog.flush()
        for ack in broker.acks:
            ack.set_exception(TimeoutError("no acknowledgement"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(awaited, 1)
        await asyncio.sleep(0)
    assert unawaited.done() and changelog.num_failed == 2
    assert sum("did not reach the broker" in r.getMessage() for r in caplog.records) == 2


async def test_what_this_path_cannot_take_goes_faust_s_way(monkeypatch: Any) -> None:
    broker = Broker()
    app, _ = app_over(broker)
    changelog = DirectChangelog(app)
    table = direct_table(app, changelog, "ledger", 4)
    faust_way: list[tuple[Any, ...]] = []

    def faust_send_changelog(self: Any, partition: Any, key: Any, value: Any, *a: Any) -> str:
        faust_way.append((partition, key, value, *a))
        return "faust"

    monkeypatch.setattr(faust.Table, "send_changelog", faust_send_changelog)
    assert table.send_changelog(None, b"k", b"v") == "faust"  # no partition named
    assert table.send_changelog(0, "k", b"v") == "faust"  # not bytes
    assert table.send_changelog(0, b"k", {"v": 1}) == "faust"
    assert table.send_changelog(0, b"k", b"v", None, "json") == "faust"  # not raw
    app.producer._producer = None  # type: ignore[attr-defined]  # not running
    assert table.send_changelog(0, b"k", b"v") == "faust"
    assert len(faust_way) == 5
    await changelog.flush()
    assert broker.records == []


async def test_a_stopped_pump_fails_what_it_still_held() -> None:
    broker = Broker()
    broker.gate = asyncio.Event()
    app, _ = app_over(broker)
    changelog = DirectChangelog(app)
    table = direct_table(app, changelog, "ledger", 4)
    futures = [table.send_changelog(0, f"t/{n}".encode(), b"x") for n in range(3)]
    await asyncio.sleep(0)
    pump = changelog._pump
    assert pump is not None
    pump.cancel()
    await asyncio.wait_for(changelog.flush(), 1)  # ends, not raising the pump's cancel
    assert all(f.cancelled() for f in futures) and broker.records == []
    # The next record starts a pump of its own.
    broker.gate.set()
    later = table.send_changelog(0, b"t/later", b"x")
    await changelog.flush()
    broker.ack()
    assert (await asyncio.wait_for(later, 1)).offset == 0


async def test_a_table_set_and_delete_under_an_event_go_to_its_partition() -> None:
    """Faust's own ``table[key] = value`` and ``del table[key]``, as the spend store and
    ``TableLedger.put`` write: the store, and a record on the event's partition."""
    broker = Broker()
    app, _ = app_over(broker)
    changelog = DirectChangelog(app)
    table = direct_table(app, changelog, "spend", 4)
    event = Event(SimpleNamespace(topic="requests.p1", partition=3))
    # As the admit agent makes its event current (what a table asks of one, no more).
    token = _current_event.set(weakref.ref(cast(Any, event)))
    try:
        table[b"acme/b"] = b"[1,0]"
        assert table[b"acme/b"] == b"[1,0]"
        del table[b"acme/b"]
        assert b"acme/b" not in table
    finally:
        _current_event.reset(token)
    await changelog.flush()
    assert broker.records == [
        ("changelog-test-spend-changelog", 3, b"acme/b", b"[1,0]"),
        ("changelog-test-spend-changelog", 3, b"acme/b", None),
    ]


async def test_the_job_s_metrics_count_records_sent_and_failed() -> None:
    broker = Broker()
    broker.refuse = {b"t/bad"}
    app, _ = app_over(broker)
    changelog = DirectChangelog(app)
    table = direct_table(app, changelog, "ledger", 4)
    for key in (b"t/a", b"t/bad", b"t/b"):
        table.send_changelog(0, key, b"x")
    await changelog.flush()
    broker.ack()
    await asyncio.sleep(0)
    registry = job_registry(
        DispatchMetrics, changelog=lambda: (changelog.num_sent, changelog.num_failed)
    )
    assert registry.get_sample_value("tokenbus_job_changelog_records_sent_total") == 2
    assert registry.get_sample_value("tokenbus_job_changelog_records_failed_total") == 1


async def test_a_store_that_persists_keeps_each_acknowledged_offset() -> None:
    """As Faust's own path does for RocksDB: the offset of each record the broker holds."""

    class PersistingStore(dict[bytes, bytes]):
        def __init__(self) -> None:
            super().__init__()
            self.persisted: list[tuple[TopicPartition, int]] = []

        def set_persisted_offset(self, tp: TopicPartition, offset: int) -> None:
            self.persisted.append((tp, offset))

    broker = Broker()
    broker.refuse = {b"t/bad"}
    app, _ = app_over(broker)
    changelog = DirectChangelog(app)
    table = direct_table(app, changelog, "ledger", 4)
    store = PersistingStore()
    table._data = cast(Any, store)
    sent = [table.send_changelog(2, key, b"x") for key in (b"t/a", b"t/bad", b"t/b")]
    await changelog.flush()
    broker.ack()
    await asyncio.wait(sent, timeout=1)
    await asyncio.sleep(0)
    topic = TopicPartition("changelog-test-ledger-changelog", 2)
    assert store.persisted == [(topic, 0), (topic, 1)]  # not the refused record's
