"""The sink's write order and retries, on a fake consumer and a fake store."""

import asyncio
import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from billing.dedup import SUPERSEDED, Stored, UsageKey
from billing.rows import USAGE_COLUMNS
from billing.sink import BillingSink, billing_group_id, close_at
from billing.storage import Row, StoredAttempts
from schemas import DeadLetter, UsageEvent, UsageStatus, decode, encode
from tokenbus.config import Settings
from tokenbus.kafka import Publish
from tokenbus.price_file import BUNDLED_PRICES, read_price_book
from tokenbus.pricing import Pricer
from tokenbus.retry import Backoff
from tokenbus.topics import Topics

TOPICS = Topics("t")
P0 = TopicPartition(TOPICS.usage, 0)
P1 = TopicPartition(TOPICS.usage, 1)
FAST = Backoff(initial_s=0.01, max_s=0.02)
PRICER = Pricer(read_price_book(BUNDLED_PRICES))
T0 = datetime(2026, 1, 1, tzinfo=UTC)
_STATUS = USAGE_COLUMNS.index("status")
_FLAGS = USAGE_COLUMNS.index("flags")


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


class FakeConsumer:
    def __init__(self, journal: list[Any], records: Mapping[TopicPartition, list[bytes]]) -> None:
        self.journal = journal
        self.queues = {
            tp: [Record(tp.topic, tp.partition, i, b"acme", v) for i, v in enumerate(values)]
            for tp, values in records.items()
        }
        self.end_offsets = {tp: len(values) for tp, values in records.items()}
        self.assigned = set(records)
        self.committed: dict[TopicPartition, int] = {}
        self.num_fetches = 0

    async def getmany(
        self, *partitions: Any, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[Any, list[Any]]:
        self.num_fetches += 1
        budget = max_records or 1_000_000
        fetched: dict[Any, list[Any]] = {}
        for tp, queue in self.queues.items():
            take, self.queues[tp] = queue[:budget], queue[budget:]
            if take:
                fetched[tp] = take
                budget -= len(take)
        if not fetched:
            await asyncio.sleep(min(timeout_ms, 5) / 1000)
        return fetched

    async def commit(self, offsets: dict[Any, int] | None = None) -> None:
        assert offsets is not None
        self.journal.append(("commit", dict(offsets)))
        self.committed.update(offsets)

    def assignment(self) -> set[Any]:
        return set(self.assigned)

    @property
    def drained(self) -> bool:
        return self.committed == {
            tp: n for tp, n in self.end_offsets.items() if tp in self.assigned
        }


class FakeStore:
    """Keeps rows by key as ClickHouse would, and drops a block whose token it has seen."""

    def __init__(
        self,
        journal: list[Any],
        *,
        num_failures: int = 0,
        num_lookup_failures: int = 0,
        num_read_back_failures: int = 0,
    ) -> None:
        self.journal = journal
        self.num_failures = num_failures
        self.num_lookup_failures = num_lookup_failures
        self.num_read_back_failures = num_read_back_failures
        self.rows: list[tuple[Any, ...]] = []
        self.tokens: list[str] = []
        self.fetches_at_insert: list[int] = []
        self.consumer: FakeConsumer | None = None

    @property
    def request_ids(self) -> list[str]:
        return [row[2] for row in self.rows]

    def look_up(self, keys: Sequence[UsageKey]) -> Stored:
        if self.num_lookup_failures > 0:
            self.num_lookup_failures -= 1
            self.journal.append(("lookup failed", len(keys)))
            raise ConnectionError("ClickHouse is down")
        self.journal.append(("lookup", len(keys)))
        stored = {(r[0], r[1], r[2], r[3]) for r in self.rows}
        requests = {key[:3] for key in keys}
        billed = {
            (r[0], r[1], r[2])
            for r in self.rows
            if len(r) > _FLAGS  # a row given as its key alone was not billed
            and (r[0], r[1], r[2]) in requests
            and r[_STATUS] != "rejected"
            and SUPERSEDED not in r[_FLAGS]
        }
        return Stored(set(keys) & stored, billed)

    def recent_attempts(self, limit: int, window_s: float) -> StoredAttempts:
        """Every stored attempt (a row given as its key alone was created at T0)."""
        if self.num_read_back_failures > 0:
            self.num_read_back_failures -= 1
            self.journal.append(("read back failed", len(self.rows)))
            raise ConnectionError("ClickHouse is down")
        self.journal.append(("read back", len(self.rows)))
        created = USAGE_COLUMNS.index("created_at")
        return StoredAttempts(
            [
                ((r[0], r[1], r[2], r[3]), _from_ticks(r[created]) if len(r) > created else T0)
                for r in self.rows
            ],
            None,
        )

    def insert_columns(self, columns: Sequence[Sequence[Any]], *, dedup_token: str) -> None:
        # The costs come in nano-units: as Decimals, as ClickHouse reads them back.
        columns = [
            [Decimal(n).scaleb(-9) for n in column] if name in _COSTS else column
            for name, column in zip(USAGE_COLUMNS, columns, strict=True)
        ]
        rows = list(zip(*columns, strict=True))
        if self.consumer is not None:
            self.fetches_at_insert.append(self.consumer.num_fetches)
        self.tokens.append(dedup_token)
        if self.num_failures > 0:
            self.num_failures -= 1
            self.journal.append(("insert failed", len(rows)))
            raise ConnectionError("ClickHouse is down")
        self.journal.append(("insert", [row[2] for row in rows]))
        self.rows.extend(rows)

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[Row]:
        raise NotImplementedError


_COSTS = ("cost_units", "billed_units")


def _from_ticks(ticks: int) -> datetime:
    """A DateTime64(3) tick of the ``created_at`` column, as ClickHouse reads it back."""
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ticks)


class FakePublish:
    def __init__(self, journal: list[Any]) -> None:
        self.journal = journal
        self.sent: list[tuple[str, bytes, bytes]] = []

    async def __call__(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> None:
        self.journal.append(("publish", topic))
        self.sent.append((topic, key, value))


def _usage(n: int, **overrides: object) -> bytes:
    fields: dict[str, object] = {
        "request_id": f"req_{n}",
        "session_id": "sess_1",
        "tenant_id": "acme",
        "model": "tiny",
        "status": UsageStatus.OK,
        "num_prompt_tokens": n,
        "created_at": T0,
    }
    fields.update(overrides)
    return encode(UsageEvent.model_validate(fields))


def test_the_group_is_tokenbus_billing_unless_the_prefix_changes(tmp_path: Path) -> None:
    assert billing_group_id(Settings(home=tmp_path)) == "tokenbus-billing"
    assert billing_group_id(Settings(home=tmp_path, topic_prefix="ci-7")) == "ci-7-billing"


def _settings(
    tmp_path: Path, batch_rows: int = 100, batch_max_rows: int = 100, insert_gap_s: float = 0.0
) -> Settings:
    return Settings(
        home=tmp_path,
        topic_prefix=TOPICS.prefix,
        billing_batch_rows=batch_rows,
        billing_batch_max_rows=batch_max_rows,
        billing_batch_interval_s=0.01,
        billing_insert_gap_s=insert_gap_s,  # the tests of the gap below set it
        billing_heap_reserve_mb=0,  # the test of its own below reserves
    )


def _sink(settings: Settings, store: FakeStore, backoff: Backoff = FAST) -> BillingSink:
    return BillingSink(settings, store, PRICER, backoff=backoff)


async def _eventually(done: Callable[[], bool]) -> None:
    for _ in range(1000):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the sink did not get there within 5 s")


async def _run_until(
    sink: BillingSink, consumer: FakeConsumer, publish: Publish, done: Callable[[], bool]
) -> None:
    """Runs the sink's loop until ``done()``, then stops it and waits for it to return."""
    stop = asyncio.Event()
    task = asyncio.create_task(sink.consume(consumer, publish, stop))
    try:
        await _eventually(done)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_inserts_then_commits_past_the_batch_and_dead_letters_bad_records(
    tmp_path: Path,
) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(
        journal, {P0: [_usage(0), b"{not json", _usage(1)], P1: [_usage(2), _usage(3)]}
    )
    store = FakeStore(journal)
    publish = FakePublish(journal)
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, publish, lambda: consumer.drained)

    # The store is read back once, at the first batch; its new attempts need no lookup.
    assert [kind for kind, _ in journal] == ["publish", "read back", "insert", "commit"]
    assert journal[-1] == ("commit", {P0: 3, P1: 2})
    assert sorted(store.request_ids) == ["req_0", "req_1", "req_2", "req_3"]
    [(topic, key, value)] = publish.sent
    letter = decode(DeadLetter, value)
    assert (topic, key) == (TOPICS.dead_letters, b"acme")
    assert (letter.source_topic, letter.partition, letter.offset) == (TOPICS.usage, 0, 1)
    assert letter.consumer == "t-billing"
    assert "not JSON" in letter.reason
    assert letter.payload == "{not json"
    assert (sink.num_inserted, sink.num_dead_letters) == (4, 1)


async def test_events_that_cannot_be_rows_are_dead_lettered_not_retried(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0, num_cached_tokens=-1), _usage(1)]})
    store = FakeStore(journal)
    publish = FakePublish(journal)
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, publish, lambda: consumer.drained)

    assert store.request_ids == ["req_1"]
    assert "num_cached_tokens" in decode(DeadLetter, publish.sent[0][2]).reason
    assert sink.num_write_failures == 0


async def test_a_failing_insert_is_retried_without_committing_or_fetching_more(
    tmp_path: Path,
) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(n) for n in range(6)]})
    store = FakeStore(journal, num_failures=3)
    store.consumer = consumer
    sink = _sink(_settings(tmp_path, batch_rows=4, batch_max_rows=4), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert journal == [
        ("read back", 0),
        ("insert failed", 4),
        ("insert failed", 4),
        ("insert failed", 4),
        ("insert", ["req_0", "req_1", "req_2", "req_3"]),
        ("commit", {P0: 4}),
        ("insert", ["req_4", "req_5"]),
        ("commit", {P0: 6}),
    ]
    # All four attempts at the first batch saw the same number of fetches: none between.
    assert len(set(store.fetches_at_insert[:4])) == 1
    # The same block was retried with the same token, so a landed try would be dropped.
    assert len(set(store.tokens[:4])) == 1
    assert store.tokens[4] != store.tokens[0]
    assert (sink.num_inserted, sink.num_write_failures) == (6, 3)


async def test_a_failing_lookup_is_retried_before_anything_is_inserted(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0), _usage(1)]})
    store = FakeStore(journal, num_lookup_failures=2, num_read_back_failures=1)
    store.rows.append(("acme", "sess_1", "req_0", 0))  # so req_0 must be looked up
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert [kind for kind, _ in journal] == [
        "read back failed",
        "read back",
        "lookup failed",
        "lookup failed",
        "lookup",
        "insert",
        "commit",
    ]
    assert store.request_ids == ["req_0", "req_1"]
    assert sink.num_write_failures == 3


async def test_copies_in_the_batch_and_attempts_already_stored_are_left_out(
    tmp_path: Path,
) -> None:
    journal: list[Any] = []
    store = FakeStore(journal)
    store.rows.append(("acme", "sess_1", "req_0", 0))  # stored by a run that crashed
    first = _usage(1, num_completion_tokens=5)
    served_again = _usage(1, num_completion_tokens=9)  # same attempt, reported twice
    consumer = FakeConsumer(
        journal, {P0: [_usage(0), first, _usage(2), served_again, _usage(2), _usage(1, attempt=1)]}
    )
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    inserted = {(row[2], row[3]): row for row in store.rows[1:]}
    assert sorted(inserted) == [("req_1", 0), ("req_1", 1), ("req_2", 0)]
    # The first copy is the one billed.
    completion = USAGE_COLUMNS.index("completion_tokens")
    assert inserted[("req_1", 0)][completion] == 5
    assert (sink.num_inserted, sink.num_duplicates) == (3, 3)
    assert consumer.committed == {P0: 6}


async def test_a_batch_of_known_attempts_inserts_nothing_and_commits(tmp_path: Path) -> None:
    journal: list[Any] = []
    store = FakeStore(journal)
    store.rows.extend([("acme", "sess_1", "req_0", 0), ("acme", "sess_1", "req_1", 0)])
    consumer = FakeConsumer(journal, {P0: [_usage(0), _usage(1)]})
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert journal == [("read back", 2), ("lookup", 2), ("commit", {P0: 2})]
    assert (sink.num_inserted, sink.num_duplicates) == (0, 2)


async def test_rows_are_priced_as_they_are_written(tmp_path: Path) -> None:
    journal: list[Any] = []
    store = FakeStore(journal)
    raw = _usage(3000, num_completion_tokens=10, model="tiny-llama", precision="int8")
    consumer = FakeConsumer(journal, {P0: [raw]})
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    [row] = store.rows
    values = dict(zip(USAGE_COLUMNS, row, strict=True))
    charge = PRICER.charge(decode(UsageEvent, raw))
    assert values["cost_weight"] == charge.cost_weight == round(1.2 * 0.7, 6)
    assert values["cost_units"] == charge.cost_units
    assert values["price_version"] == 1


async def test_a_batch_line_is_written_with_its_batch_at_the_batch_price(tmp_path: Path) -> None:
    journal: list[Any] = []
    store = FakeStore(journal)
    line = _usage(3000, num_completion_tokens=10, model="tiny-llama", batch_id="b1", priority=2)
    alone = _usage(3001, num_completion_tokens=10, model="tiny-llama")
    consumer = FakeConsumer(journal, {P0: [line, alone]})
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    batch_row, other_row = (dict(zip(USAGE_COLUMNS, row, strict=True)) for row in store.rows)
    assert (batch_row["batch_id"], other_row["batch_id"]) == ("b1", "")
    event = decode(UsageEvent, line)
    at_list_price = PRICER.charge(event.model_copy(update={"batch_id": None})).cost_units
    assert batch_row["cost_units"] == PRICER.charge(event).cost_units
    assert batch_row["cost_units"] == PRICER.book.batch_multiplier * at_list_price > 0


async def test_stopping_during_an_outage_commits_nothing(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0), _usage(1)]})
    store = FakeStore(journal, num_failures=1_000)
    sink = _sink(_settings(tmp_path), store, Backoff(initial_s=60, max_s=60))

    await _run_until(sink, consumer, FakePublish(journal), lambda: bool(journal))

    assert journal == [("read back", 0), ("insert failed", 2)]
    assert consumer.committed == {}
    assert sink.num_inserted == 0


def test_a_batch_closes_after_its_interval_but_not_within_the_gap_of_the_last() -> None:
    assert close_at(10.0, None, 1.0, 5.0) == 11.0  # the first batch: the interval
    assert close_at(10.0, 9.5, 1.0, 5.0) == 14.5  # a trickle: the gap from the last close
    assert close_at(10.0, 8.5, 1.0, 0.5) == 11.0  # a gap shorter than the interval
    assert close_at(10.0, 2.0, 1.0, 5.0) == 11.0  # after a quiet spell: the interval
    assert close_at(10.0, 9.5, 1.0, 0.0) == 11.0  # no gap: the interval alone


def _add(consumer: FakeConsumer, tp: TopicPartition, values: Sequence[bytes]) -> None:
    """Records that come to the partition now, after those before them."""
    for value in values:
        offset = consumer.end_offsets[tp]
        consumer.queues[tp].append(Record(tp.topic, tp.partition, offset, b"acme", value))
        consumer.end_offsets[tp] = offset + 1


async def test_a_trickle_is_inserted_once_a_gap_and_a_full_batch_at_once(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0)]})
    store = FakeStore(journal)
    sink = _sink(_settings(tmp_path, batch_rows=4, batch_max_rows=4, insert_gap_s=0.5), store)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    task = asyncio.create_task(sink.consume(consumer, FakePublish(journal), stop))

    def inserts() -> list[list[str]]:
        return [ids for kind, ids in journal if kind == "insert"]

    try:
        started = loop.time()
        await _eventually(lambda: len(inserts()) == 1)
        first_s = loop.time() - started  # the first batch: its interval, no gap before it
        closed = loop.time()
        for n in (1, 2):  # a trickle: a record now and then, each batch's first one soon
            _add(consumer, P0, [_usage(n)])
            await asyncio.sleep(0.05)
        await _eventually(lambda: len(inserts()) == 2)
        trickle_s = loop.time() - closed
        closed = loop.time()
        _add(consumer, P0, [_usage(n) for n in range(3, 7)])  # batch_rows at once
        await _eventually(lambda: len(inserts()) == 3)
        full_s = loop.time() - closed
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)

    assert first_s < 0.4
    assert trickle_s >= 0.45  # held to the gap, though each record's interval had passed
    assert full_s < 0.4  # a full batch closes at once, gap or not
    assert inserts() == [["req_0"], ["req_1", "req_2"], ["req_3", "req_4", "req_5", "req_6"]]
    assert consumer.drained


async def test_a_stop_during_a_gap_flushes_the_batch_in_hand_at_once(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0)]})
    store = FakeStore(journal)
    sink = _sink(_settings(tmp_path, insert_gap_s=30.0), store)
    stop = asyncio.Event()
    task = asyncio.create_task(sink.consume(consumer, FakePublish(journal), stop))
    try:
        await _eventually(lambda: store.request_ids == ["req_0"])
        _add(consumer, P0, [_usage(1)])
        await _eventually(lambda: not consumer.queues[P0])  # fetched: held for the gap
        await asyncio.sleep(0.1)
        assert store.request_ids == ["req_0"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 2)

    assert store.request_ids == ["req_0", "req_1"]
    assert consumer.drained


async def test_batches_hold_at_most_batch_max_rows(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(
        journal, {P0: [_usage(n) for n in range(4)], P1: [_usage(n) for n in range(10, 13)]}
    )
    store = FakeStore(journal)
    sink = _sink(_settings(tmp_path, batch_rows=2, batch_max_rows=3), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    inserts = [len(ids) for kind, ids in journal if kind == "insert"]
    assert max(inserts) == 3
    assert sum(inserts) == 7


async def test_a_backlog_is_taken_in_batches_larger_than_batch_rows(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(n) for n in range(50)]})
    store = FakeStore(journal)
    sink = _sink(_settings(tmp_path, batch_rows=10, batch_max_rows=40), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert [len(ids) for kind, ids in journal if kind == "insert"] == [40, 10]


async def test_revoking_waits_for_the_batch_in_hand(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0)]})
    store = FakeStore(journal)
    release = asyncio.Event()
    original = store.insert_columns

    def slow_insert(columns: Sequence[Sequence[Any]], *, dedup_token: str) -> None:
        journal.append(("insert started", len(columns[0])))
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result()
        original(columns, dedup_token=dedup_token)

    loop = asyncio.get_running_loop()
    store.insert_columns = slow_insert  # type: ignore[method-assign]
    sink = _sink(_settings(tmp_path), store, FAST)
    listener = sink.rebalance_listener()

    stop = asyncio.Event()
    task = asyncio.create_task(sink.consume(consumer, FakePublish(journal), stop))
    await _eventually(lambda: ("insert started", 1) in journal)
    revoke = asyncio.create_task(listener.on_partitions_revoked({P0}))
    await asyncio.sleep(0.05)
    assert not revoke.done()  # the batch is still being written
    release.set()
    await asyncio.wait_for(revoke, 5)
    journal.append(("revoked", None))
    stop.set()
    await asyncio.wait_for(task, 5)

    assert [kind for kind, _ in journal] == [
        "read back",
        "insert started",
        "insert",
        "commit",
        "revoked",
    ]


async def test_only_assigned_partitions_are_committed(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0)], P1: [_usage(1)]})
    consumer.assigned = {P0}  # P1 moved to another member after this batch was fetched
    store = FakeStore(journal)
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert consumer.committed == {P0: 1}


@pytest.mark.parametrize("num_failures", [1, 2])
async def test_a_failing_dead_letter_send_is_retried_before_the_commit(
    tmp_path: Path, num_failures: int
) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [b"[]"]})
    publish = FakePublish(journal)
    remaining = [num_failures]

    async def flaky_publish(
        topic: str, key: bytes, value: bytes, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> None:
        if remaining[0] > 0:
            remaining[0] -= 1
            journal.append(("publish failed", topic))
            raise ConnectionError("broker away")
        await publish(topic, key, value)

    sink = _sink(_settings(tmp_path), FakeStore(journal), FAST)

    await _run_until(sink, consumer, flaky_publish, lambda: consumer.drained)

    assert [kind for kind, _ in journal] == ["publish failed"] * num_failures + [
        "publish",
        "commit",
    ]
    assert (sink.num_dead_letters, sink.num_write_failures) == (1, num_failures)


async def test_the_heap_reserve_is_taken_once_with_the_configured_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reserved: list[int] = []

    def reserve_heap(mib: int) -> list[bytes]:
        reserved.append(mib)
        return [b"pin"]

    monkeypatch.setattr("billing.sink.reserve_heap", reserve_heap)
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0), _usage(1)], P1: [_usage(2)]})
    settings = _settings(tmp_path, batch_rows=1, batch_max_rows=1).model_copy(
        update={"billing_heap_reserve_mb": 7}
    )
    sink = _sink(settings, FakeStore(journal), FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)
    await _run_until(sink, consumer, FakePublish(journal), lambda: True)

    assert reserved == [7]  # at the first consume, not per batch or per run
    assert [kind for kind, _ in journal].count("insert") == 3


async def test_the_cycle_collector_pauses_for_a_batch_only(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0)]})
    store = FakeStore(journal)
    seen: list[bool] = []
    original = store.insert_columns

    def insert_columns(columns: Sequence[Sequence[Any]], *, dedup_token: str) -> None:
        seen.append(gc.isenabled())
        original(columns, dedup_token=dedup_token)

    store.insert_columns = insert_columns  # type: ignore[method-assign]
    sink = _sink(_settings(tmp_path), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert seen == [False]
    assert gc.isenabled()


async def test_the_cycle_collector_pauses_from_a_first_record_to_the_batch_freed(
    tmp_path: Path,
) -> None:
    # Two fetches make one batch (batch_rows 2, one record per fetch): the collector is on
    # for the first fetch, off for the second, and on again, with a collection run, once
    # the batch is written.
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0), _usage(1)]})
    store = FakeStore(journal)
    enabled_at_fetch: list[bool] = []
    collections: list[int] = []
    getmany = consumer.getmany

    async def one_record_a_fetch(
        *partitions: Any, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[Any, list[Any]]:
        enabled_at_fetch.append(gc.isenabled())
        return await getmany(*partitions, timeout_ms=timeout_ms, max_records=1)

    def on_collect(phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info["generation"] == 2:
            collections.append(len(journal))

    consumer.getmany = one_record_a_fetch  # type: ignore[method-assign]
    sink = _sink(_settings(tmp_path, batch_rows=2, batch_max_rows=2), store, FAST)
    gc.callbacks.append(on_collect)
    try:
        await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)
    finally:
        gc.callbacks.remove(on_collect)

    assert enabled_at_fetch[:2] == [True, False]
    assert all(enabled_at_fetch[2:])  # idle: as it was
    assert gc.isenabled()
    assert [kind for kind, _ in journal] == ["read back", "insert", "commit"]
    assert len(journal) in collections  # a full collection once the batch was committed


async def test_a_copy_in_a_later_batch_is_the_only_attempt_looked_up(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(
        journal, {P0: [_usage(0), _usage(1), _usage(2), _usage(1, num_completion_tokens=9)]}
    )
    store = FakeStore(journal)
    sink = _sink(_settings(tmp_path, batch_rows=3, batch_max_rows=3), store, FAST)

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert journal == [
        ("read back", 0),
        ("insert", ["req_0", "req_1", "req_2"]),
        ("commit", {P0: 3}),
        ("lookup", 1),
        ("commit", {P0: 4}),
    ]
    assert (sink.num_inserted, sink.num_duplicates) == (3, 1)


async def test_an_assignment_reads_the_recent_attempts_back_again(tmp_path: Path) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0)]})
    store = FakeStore(journal)
    sink = _sink(_settings(tmp_path), store, FAST)
    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)
    # Meanwhile another member billed req_1 (say P0 was its partition for a while).
    store.rows.append(("acme", "sess_1", "req_1", 0))
    await sink.rebalance_listener().on_partitions_assigned({P0})
    consumer.queues[P0].append(Record(P0.topic, 0, 1, b"acme", _usage(1)))
    consumer.end_offsets[P0] = 2

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert journal[3:] == [("read back", 2), ("lookup", 1), ("commit", {P0: 2})]
    assert store.request_ids == ["req_0", "req_1"]


async def test_records_of_a_partition_revoked_while_gathering_are_left_to_its_owner(
    tmp_path: Path,
) -> None:
    journal: list[Any] = []
    consumer = FakeConsumer(journal, {P0: [_usage(0)], P1: [_usage(1)]})
    store = FakeStore(journal)
    sink = _sink(_settings(tmp_path), store, FAST)
    listener = sink.rebalance_listener()
    fetch = consumer.getmany
    fetched_p1 = [False]

    async def getmany_then_lose_p1(*args: Any, **kwargs: Any) -> dict[Any, list[Any]]:
        # P1 moves to another member between two fetches of the batch being gathered
        # (aiokafka returns no record of a partition once it is revoked).
        if fetched_p1[0] and P1 in consumer.assigned:
            consumer.assigned.discard(P1)
            await listener.on_partitions_revoked({P1})
        fetched = await fetch(*args, **kwargs)
        fetched_p1[0] = fetched_p1[0] or P1 in fetched
        return fetched

    consumer.getmany = getmany_then_lose_p1  # type: ignore[method-assign]

    await _run_until(sink, consumer, FakePublish(journal), lambda: consumer.drained)

    assert store.request_ids == ["req_0"]
    assert consumer.committed == {P0: 1}


@pytest.mark.parametrize("batch_rows", [1, 100], ids=["batch-each", "one-batch"])
@pytest.mark.parametrize("first", [1, 0], ids=["resent-first", "first-first"])
async def test_a_request_run_twice_is_billed_for_the_run_reported_first(
    tmp_path: Path, batch_rows: int, first: int
) -> None:
    # A worker presumed lost finished anyway: both attempts ran to their end, and the
    # client heard one stream. Whichever reports first is billed; the other is stored
    # with its cost, billed nothing, flagged superseded. A replay bills the same one.
    journal: list[Any] = []
    reports = [_usage(0, attempt=a, num_completion_tokens=8) for a in (first, 1 - first)]
    consumer = FakeConsumer(journal, {P0: [*reports, _usage(1)]})
    store = FakeStore(journal)
    settings = _settings(tmp_path, batch_rows=batch_rows, batch_max_rows=batch_rows)

    await _run_until(
        _sink(settings, store), consumer, FakePublish(journal), lambda: consumer.drained
    )
    replayed = FakeConsumer(journal, {P0: [*reports, _usage(1)]})
    await _run_until(
        _sink(settings, store), replayed, FakePublish(journal), lambda: replayed.drained
    )

    rows = {(r[2], r[3]): dict(zip(USAGE_COLUMNS, r, strict=True)) for r in store.rows}
    assert len(store.rows) == 3 and len(rows) == 3  # each attempt once, replay or not
    billed, later = rows[("req_0", first)], rows[("req_0", 1 - first)]
    assert billed["billed_units"] == billed["cost_units"] > 0
    assert SUPERSEDED not in billed["flags"]
    assert later["cost_units"] == billed["cost_units"] and later["billed_units"] == 0
    assert SUPERSEDED in later["flags"]
    assert SUPERSEDED not in rows[("req_1", 0)]["flags"]


async def test_a_refused_attempt_supersedes_nothing(tmp_path: Path) -> None:
    journal: list[Any] = []
    refused = _usage(0, status=UsageStatus.REJECTED)
    consumer = FakeConsumer(journal, {P0: [refused, _usage(0, attempt=1, num_completion_tokens=4)]})
    store = FakeStore(journal)

    await _run_until(
        _sink(_settings(tmp_path), store), consumer, FakePublish(journal), lambda: consumer.drained
    )

    ran = dict(zip(USAGE_COLUMNS, store.rows[1], strict=True))
    assert ran["attempt"] == 1 and ran["billed_units"] > 0 and SUPERSEDED not in ran["flags"]
