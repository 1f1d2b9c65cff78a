"""The job's trust boundary: what a hostile or careless producer gets published.

Pure: a recording publisher, a memory ledger and window store, real credentials (API
keys from a tenants file, service tokens) checked by ``tokenbus.auth``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner

from schemas.codec import SchemaError, decode, encode
from schemas.fleet import WorkerStatus
from schemas.messages import DeadLetter, WorkItem
from schemas.replies import TokenChunk, TokenChunkBatch
from schemas.usage import UsageEvent, UsageStatus
from stream_jobs.dispatcher import Dispatcher, Outcome, Record
from stream_jobs.ledger import MAX_COPIES, State
from tests.unit.fakes import (
    TOPICS,
    ManualClock,
    Recorder,
    bearer,
    cancel,
    memory_dispatcher,
    reply_topic,
    service_headers,
)
from tokenbus.config import Settings
from tokenbus.kafka import key_partition
from tokenbus.tenants import hash_api_key

NOW = float(int(datetime(2026, 3, 2, 10, 0, tzinfo=UTC).timestamp()))
ADMITTED = datetime.fromtimestamp(NOW, UTC)
ACME_KEY, BETA_KEY, SOLO_KEY = "sk-acme-key", "sk-beta-key", "sk-solo-key"
ACME, BETA = reply_topic("acme"), reply_topic("beta")
WORKER = "tokenbus.worker.w"
TENANTS = f"""
[tenants.acme]
priority_class = 1
models = ["m"]
sharing_group = "team"
api_key_sha256 = ["{hash_api_key(ACME_KEY)}"]

[tenants.beta]
priority_class = 2
api_key_sha256 = ["{hash_api_key(BETA_KEY)}"]

[tenants.solo]
priority_class = 0
api_key_sha256 = ["{hash_api_key(SOLO_KEY)}"]
"""


class Bus:
    """A dispatcher on a fixed clock, with one live worker, and what it published."""

    def __init__(self, dispatcher: Dispatcher, recorder: Recorder) -> None:
        self.dispatcher = dispatcher
        self.recorder = recorder

    async def produce(
        self,
        body: dict[str, Any],
        *,
        headers: list[tuple[str, bytes]] | None,
        key: bytes | None = b"acme",
        raw: bytes | None = None,
    ) -> Outcome:
        value = raw if raw is not None else orjson.dumps(body)
        handled = self.dispatcher.handle_request(Record("p", 0, 0, key, value, headers))
        return await asyncio.wait_for(handled, 2)

    def chunks(self, topic: str) -> list[TokenChunk]:
        return self.recorder.chunks_on(topic)

    def usage(self) -> list[UsageEvent]:
        return [decode(UsageEvent, v) for v in self.recorder.on(TOPICS.usage)]

    def forwarded(self) -> list[WorkItem]:
        return [decode(WorkItem, v) for v in self.recorder.on(WORKER)]

    def dead_letters(self) -> list[DeadLetter]:
        return [decode(DeadLetter, v) for v in self.recorder.on(TOPICS.dead_letters)]

    def topics(self) -> set[str]:
        return {topic for topic, _, _ in self.recorder.sent}

    def finish(self, tenant: str, request_id: str, last_seq: int) -> None:
        """The worker's UsageEvent for a request that ran to its end."""
        usage = UsageEvent(
            request_id=request_id,
            session_id=request_id,
            tenant_id=tenant,
            model="m",
            status=UsageStatus.OK,
            num_prompt_tokens=2,
            num_completion_tokens=last_seq + 1,
            created_at=ADMITTED,
            last_seq=last_seq,
        )
        self.dispatcher.observe_usage(encode(usage))


def body(request_id: str = "r1", tenant: str | None = "acme", **fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "request_id": request_id,
        "model": "m",
        "prompt": "hello",
        "reply_to": reply_topic(tenant or "acme"),
        "sampling": {"max_tokens": 8},
    }
    if tenant is not None:
        data["tenant_id"] = tenant
    return data | fields


def heartbeat() -> bytes:
    return encode(
        WorkerStatus(
            worker_id="w",
            model="m",
            request_topic=WORKER,
            max_num_seqs=8,
            num_running=0,
            incarnation="run-1",
        )
    )


def make_bus(
    tmp_path: Path,
    settings: dict[str, Any] | None = None,
    recorder: Recorder | None = None,
    **options: Any,
) -> Bus:
    """A dispatcher for ``TENANTS`` (no others), with one live worker; ``settings`` and
    ``options`` (for ``Dispatcher``) on top of the defaults."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    merged = {"home": tmp_path, "tenants_file": tenants, "vip_reserve": 0.0, **(settings or {})}
    recorder = recorder or Recorder()
    dispatcher = memory_dispatcher(
        Settings(**merged), recorder, allow_unlisted=False, clock=ManualClock(NOW), **options
    )
    dispatcher.observe_heartbeat(heartbeat())
    return Bus(dispatcher, recorder)


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[Bus]:
    made = make_bus(tmp_path, {"worker_dead_after_s": 0.3})
    loop = asyncio.create_task(made.dispatcher.run())
    yield made
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)


def only(items: list[Any]) -> Any:
    assert len(items) == 1, items
    return items[0]


# -- who is producing ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("headers", "code"),
    [
        (None, "missing_credential"),
        ([("authorization", b"Basic abc")], "missing_credential"),
        (bearer("sk-stolen"), "invalid_api_key"),
        (bearer("eyJhbGciOiJIUzI1NiJ9.eyJ0ZW5hbnQiOiJhY21lIn0.c2ln"), "invalid_credential"),
    ],
)
async def test_no_credential_is_answered_and_dead_lettered_but_records_nothing(
    bus: Bus, headers: list[tuple[str, bytes]] | None, code: str
) -> None:
    assert await bus.produce(body(), headers=headers) is Outcome.REFUSED
    chunk = only(bus.chunks(ACME))
    assert chunk.error.code == code and chunk.finish_reason == "rejected"
    assert only(bus.dead_letters()).reason.startswith(f"{code}: ")
    # The tenant is only claimed: no usage row (nor window, budget or ledger entry).
    assert bus.topics() == {ACME, TOPICS.dead_letters}
    assert bus.dispatcher.metrics.num_unauthenticated == 1


@pytest.mark.parametrize("claim", ["tenant_id", "key"])
async def test_an_unproven_refusal_under_a_victim_s_id_leaves_its_real_request_whole(
    bus: Bus, claim: str
) -> None:
    forged = body("x1") if claim == "tenant_id" else body("x1", tenant=None)
    key = b"acme" if claim == "tenant_id" else b"acme/batch"
    assert await bus.produce(forged, headers=None, key=key) is Outcome.REFUSED
    assert TOPICS.usage not in bus.topics()

    real = body("x1", prompt="hello " * 50)
    assert await bus.produce(real, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    _, reserved, settled = bus.dispatcher._store.load("acme").reservations["x1"]
    assert reserved > 50 and not settled  # its prompt and max_tokens, until its own row
    assert bus.dispatcher._store.load("acme").used() == (reserved, 1)
    assert ("acme", "x1") in bus.dispatcher._in_flight
    assert [u.request_id for u in bus.usage()] == []  # the run's own row is its only one


@pytest.mark.parametrize("key", [b"../etc", b"a b", b"\xff"])
async def test_an_unproven_record_claiming_no_tenant_shape_is_only_dead_lettered(
    bus: Bus, key: bytes
) -> None:
    assert await bus.produce(body(tenant=None), headers=None, key=key) is Outcome.REFUSED
    assert only(bus.dead_letters()).reason.startswith("missing_credential: ")
    assert bus.topics() == {TOPICS.dead_letters}


async def test_a_key_of_one_tenant_cannot_claim_another(bus: Bus) -> None:
    claim = body(tenant="beta", reply_to=ACME)
    assert await bus.produce(claim, headers=bearer(ACME_KEY), key=b"beta") is Outcome.REFUSED
    chunk = only(bus.chunks(ACME))
    assert chunk.error.code == "tenant_mismatch" and chunk.tenant_id == "acme"
    # Keyed by beta, it sits on beta's partition: nothing of acme's is written from there,
    # no usage row either (its id stays free for a retry keyed right).
    assert "tenant_mismatch" in only(bus.dead_letters()).reason
    assert bus.topics() == {ACME, TOPICS.dead_letters}
    assert bus.dispatcher.metrics.num_forbidden == 1


async def test_a_key_of_one_tenant_claiming_another_on_its_own_partition(bus: Bus) -> None:
    claim = body(tenant="beta", reply_to=ACME)
    assert await bus.produce(claim, headers=bearer(ACME_KEY), key=b"acme") is Outcome.REFUSED
    chunk = only(bus.chunks(ACME))
    assert chunk.error.code == "tenant_mismatch" and chunk.tenant_id == "acme"
    usage = only(bus.usage())
    assert (usage.tenant_id, usage.error_code) == ("acme", "tenant_mismatch")
    assert bus.topics() == {ACME, TOPICS.usage}
    # The id has had its answer: the same again is a duplicate, not a second refusal row.
    assert await bus.produce(claim, headers=bearer(ACME_KEY), key=b"acme") is Outcome.DUPLICATE
    assert len(bus.usage()) == 1


@pytest.mark.parametrize("key", [b"beta", b"", None, b"acme "])
async def test_a_record_must_be_keyed_by_its_tenant(bus: Bus, key: bytes | None) -> None:
    assert await bus.produce(body(), headers=bearer(ACME_KEY), key=key) is Outcome.REFUSED
    chunk = only(bus.chunks(ACME))
    assert chunk.error.code == "invalid_key"
    assert "invalid_key" in only(bus.dead_letters()).reason
    assert bus.topics() == {ACME, TOPICS.dead_letters}  # no usage row, no ledger entry
    # Sent again keyed right, it runs.
    assert await bus.produce(body(), headers=bearer(ACME_KEY), key=b"acme") is Outcome.FORWARDED


async def test_a_body_without_tenant_id_is_the_credential_s_tenant(bus: Bus) -> None:
    assert await bus.produce(body(tenant=None), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    assert only(bus.forwarded()).tenant_id == "acme"


# -- where answers go --------------------------------------------------------------------
@pytest.mark.parametrize(
    "reply_to", [BETA, TOPICS.heartbeats, TOPICS.usage, TOPICS.replies("acme"), "elsewhere"]
)
async def test_a_reply_topic_the_credential_does_not_own_hears_nothing(
    bus: Bus, reply_to: str
) -> None:
    request = body(reply_to=reply_to)
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.REFUSED
    assert not [v for t, _, v in bus.recorder.sent if t == reply_to and t != TOPICS.usage]
    letter = only(bus.dead_letters())
    assert "reply_to" in letter.reason and "tokenbus.replies.acme." in letter.reason
    usage = only(bus.usage())
    assert (usage.tenant_id, usage.status) == ("acme", "rejected")
    assert usage.error_code == "reply_topic_forbidden"
    assert bus.topics() == {TOPICS.dead_letters, TOPICS.usage}


async def test_claiming_another_tenant_and_its_reply_topic_reaches_neither(bus: Bus) -> None:
    claim = body(tenant="beta")  # beta's id, beta's reply topic, acme's key
    assert await bus.produce(claim, headers=bearer(ACME_KEY), key=b"beta") is Outcome.REFUSED
    assert not bus.chunks(BETA)
    assert not bus.usage()  # nothing under beta's name, nor acme's from beta's partition
    assert "tenant_mismatch" in only(bus.dead_letters()).reason


# -- what a producer may not set ---------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"), [("cache_salt", "group:other"), ("attempt", 3), ("flags", ["vip"])]
)
async def test_an_internal_field_is_dead_lettered_and_named(
    bus: Bus, field: str, value: Any
) -> None:
    request = body() | {field: value}
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.REFUSED
    assert field in only(bus.dead_letters()).reason
    chunk = only(bus.chunks(ACME))  # best effort: its producer need not wait for a timeout
    assert chunk.error.code == "invalid_request" and field in chunk.error.message
    assert not bus.forwarded() and not bus.usage()


async def test_an_old_created_at_is_clamped_and_prices_go_by_admission(bus: Bus) -> None:
    old = body(created_at="2001-01-01T00:00:00Z")
    assert await bus.produce(old, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    item = only(bus.forwarded())
    skew = timedelta(seconds=Settings().created_at_skew_s)
    assert item.admitted_at == ADMITTED
    assert item.created_at == ADMITTED - skew
    # A refusal's UsageEvent is dated by admission, not by the producer.
    refused = body("r2", model="not-allowed", created_at="2001-01-01T00:00:00Z")
    assert await bus.produce(refused, headers=bearer(ACME_KEY)) is Outcome.REFUSED
    usage = only(bus.usage())
    assert usage.error_code == "model_not_allowed" and usage.created_at == ADMITTED


async def test_a_created_at_in_the_future_is_clamped_to_admission(bus: Bus) -> None:
    future = body(created_at="2099-01-01T00:00:00Z")
    assert await bus.produce(future, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    assert only(bus.forwarded()).created_at == ADMITTED


async def test_a_created_at_without_a_timezone_does_not_crash_the_job(bus: Bus) -> None:
    naive = body(created_at="2026-03-02T09:59:00")
    outcome = await bus.produce(naive, headers=bearer(ACME_KEY))
    assert outcome in (Outcome.FORWARDED, Outcome.REFUSED)


@pytest.mark.parametrize(
    ("key", "tenant", "expected"), [(BETA_KEY, "beta", 2), (ACME_KEY, "acme", 1)]
)
async def test_a_priority_better_than_the_tenant_s_class_is_clamped(
    bus: Bus, key: str, tenant: str, expected: int
) -> None:
    vip = body(tenant=tenant, priority=0)
    assert await bus.produce(vip, headers=bearer(key), key=tenant.encode()) is Outcome.FORWARDED
    assert only(bus.forwarded()).priority == expected


async def test_a_class_0_tenant_keeps_class_0(bus: Bus) -> None:
    vip = body(tenant="solo", priority=0)
    assert await bus.produce(vip, headers=bearer(SOLO_KEY), key=b"solo") is Outcome.FORWARDED
    assert only(bus.forwarded()).priority == 0


async def test_the_cache_salt_comes_from_the_tenant_or_its_sharing_group(bus: Bus) -> None:
    assert await bus.produce(body(), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    solo = body(tenant="solo")
    assert await bus.produce(solo, headers=bearer(SOLO_KEY), key=b"solo") is Outcome.FORWARDED
    salts = {item.tenant_id: item.cache_salt for item in bus.forwarded()}
    assert salts == {"acme": "group:team", "solo": "solo"}


async def test_flags_come_only_from_a_service_token(bus: Bus) -> None:
    flagged = service_headers("acme", flags=["injection_suspected"])
    assert await bus.produce(body(), headers=flagged) is Outcome.FORWARDED
    assert only(bus.forwarded()).flags == ["injection_suspected"]


# -- one request id, one run -------------------------------------------------------------
async def test_the_same_request_three_times_runs_once(bus: Bus) -> None:
    request = body()
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    # Running, same reply topic: nothing breaks into the one stream...
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    assert len(bus.forwarded()) == 1 and not bus.chunks(ACME) and not bus.usage()
    bus.finish("acme", "r1", last_seq=4)
    # ...and the copy has its answer once the stream has ended: one duplicate_request
    # chunk after it, and no UsageEvent.
    await bus.dispatcher.publish_raised()
    chunk = only(bus.chunks(ACME))
    assert chunk.error.code == "duplicate_request" and chunk.seq == 5
    assert "has had its answer, earlier on this reply topic" in chunk.error.message
    assert chunk.finish_reason == "rejected"
    # Finished: each copy one chunk more, each with a seq of its own.
    for _ in range(2):
        assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    assert [c.seq for c in bus.chunks(ACME)] == [5, 6, 7]
    assert {c.error and c.error.code for c in bus.chunks(ACME)} == {"duplicate_request"}
    assert len(bus.forwarded()) == 1 and not bus.usage()
    assert bus.dispatcher.metrics.num_duplicates == 3


async def test_a_copy_answered_while_the_answer_before_it_waits_goes_after_it(
    bus: Bus,
) -> None:
    """The answer owed to a copy taken while the request ran waits for the producer's
    metadata of the reply topic (its first record there); a copy that comes meanwhile
    is answered with the next seq, and must not reach the topic before it."""
    request = body()
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    bus.finish("acme", "r1", last_seq=4)
    metadata = bus.recorder.stall(ACME)
    owed = asyncio.create_task(bus.dispatcher.publish_raised())
    await asyncio.sleep(0)  # the owed answer, seq 5, waits at the stall
    copy = asyncio.create_task(bus.produce(request, headers=bearer(ACME_KEY)))
    for _ in range(5):
        await asyncio.sleep(0)  # the copy's answer, seq 6, may send now
    metadata.set()
    await owed
    assert await copy is Outcome.DUPLICATE
    assert [c.seq for c in bus.chunks(ACME)] == [5, 6]


async def test_a_copy_sent_as_its_stream_ends_is_answered(bus: Bus) -> None:
    """The worker writes the last chunk, and the job hears of the end from its UsageEvent
    a moment later: a copy taken in between must not go unanswered."""
    request = body()
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    # (the stream's last chunk, seq 3, is on the reply topic now; its usage is not read)
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    await bus.dispatcher.publish_raised()
    assert not bus.chunks(ACME)  # not before the end: it would cut into the stream
    bus.finish("acme", "r1", last_seq=3)
    await bus.dispatcher.publish_raised()
    answers = [(c.seq, c.error and c.error.code) for c in bus.chunks(ACME)]
    assert answers == [(4, "duplicate_request")]
    await bus.dispatcher.publish_raised()
    assert len(bus.chunks(ACME)) == 1  # answered once


async def test_a_flood_of_copies_is_answered_up_to_a_bound_and_the_rest_dead_lettered(
    bus: Bus,
) -> None:
    request = body()
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    for _ in range(MAX_COPIES + 3):
        assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    flooded = bus.dead_letters()
    assert len(flooded) == 3 and f"more than {MAX_COPIES} copies" in flooded[0].reason
    bus.finish("acme", "r1", last_seq=1)
    await bus.dispatcher.publish_raised()
    # One record, a chunk a copy, each with a seq of its own after the stream's.
    (record,) = bus.recorder.on(ACME)
    batch = decode(TokenChunkBatch, record)
    assert [c.seq for c in batch.chunks] == list(range(2, 2 + MAX_COPIES))
    assert {c.error and c.error.code for c in batch.chunks} == {"duplicate_request"}
    assert len(bus.forwarded()) == 1 and not bus.usage()


async def test_a_copy_of_a_request_running_past_its_dedupe_window_is_answered(bus: Bus) -> None:
    request = body()
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    clock = bus.dispatcher._clock
    assert isinstance(clock, ManualClock)
    clock.advance(Settings().request_dedupe_s + 1)  # its entry expires, and is swept
    bus.dispatcher.observe_heartbeat(heartbeat())  # (the worker is still there)
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    assert len(bus.forwarded()) == 1
    bus.finish("acme", "r1", last_seq=2)
    await bus.dispatcher.publish_raised()
    answers = [(c.seq, c.error and c.error.code) for c in bus.chunks(ACME)]
    assert answers == [(3, "duplicate_request")]


async def test_a_copy_of_a_request_cancelled_while_it_waited_is_answered_after_its_end(
    bus: Bus,
) -> None:
    for n in range(8):  # the worker's eight seats
        assert await bus.produce(body(f"busy{n}"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    request = body("r9")
    first = asyncio.create_task(bus.produce(request, headers=bearer(ACME_KEY)))
    await asyncio.sleep(0.05)
    assert not first.done()  # waiting for a seat
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    await cancel(bus.dispatcher, "acme", "r9")
    assert await first is Outcome.CANCELLED
    mine = [c for c in bus.chunks(ACME) if c.request_id == "r9"]
    assert [(c.seq, c.error and c.error.code) for c in mine] == [
        (0, "cancelled"),
        (1, "duplicate_request"),
    ]


async def test_a_waiting_request_is_judged_from_memory_and_written_once_forwarded(
    bus: Bus,
) -> None:
    """Nothing of an admitted request is in the ledger before its forward (its event
    stays unacked until then); a copy meanwhile is judged against the request held."""
    for n in range(8):  # the worker's eight seats
        assert await bus.produce(body(f"busy{n}"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    ledger = bus.dispatcher._ledger
    first = asyncio.create_task(bus.produce(body("r9"), headers=bearer(ACME_KEY)))
    await asyncio.sleep(0.05)
    assert not first.done()  # waiting for a seat
    assert ledger.get("acme", "r9") is None
    # For another reply topic: a duplicate, answered at once.
    other = reply_topic("acme", "c2")
    assert await bus.produce(body("r9", reply_to=other), headers=bearer(ACME_KEY)) is (
        Outcome.DUPLICATE
    )
    chunk = only(bus.chunks(other))
    assert chunk.error.code == "duplicate_request" and chunk.seq == 0
    assert "is running, for another reply topic" in chunk.error.message
    assert ledger.get("acme", "r9") is None  # answered; nothing owed after the stream
    # For the same one: counted, in an ADMITTED entry (a job restarted now runs it).
    assert await bus.produce(body("r9"), headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    held = ledger.get("acme", "r9")
    assert held is not None and (held.state, held.copies) == (State.ADMITTED, 1)
    bus.finish("acme", "busy0", last_seq=0)  # a seat frees
    assert await first is Outcome.FORWARDED
    entry = ledger.get("acme", "r9")
    assert entry is not None and (entry.state, entry.copies) == (State.FORWARDED, 1)
    assert entry.forward is not None
    assert [i.request_id for i in bus.forwarded()].count("r9") == 1


async def test_a_running_request_asked_for_on_another_reply_topic_is_a_duplicate(
    bus: Bus,
) -> None:
    assert await bus.produce(body(), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    other = reply_topic("acme", "c2")
    again = body(reply_to=other)
    assert await bus.produce(again, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    chunk = only(bus.chunks(other))
    assert chunk.error.code == "duplicate_request" and chunk.seq == 0
    assert "is running, for another reply topic" in chunk.error.message
    assert len(bus.forwarded()) == 1 and not bus.usage() and not bus.chunks(ACME)


@pytest.mark.parametrize("finished", [False, True], ids=["running", "finished"])
async def test_an_unproven_record_reusing_a_known_id_is_only_dead_lettered(
    bus: Bus, finished: bool
) -> None:
    assert await bus.produce(body(), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    if finished:
        bus.finish("acme", "r1", last_seq=2)
    before = list(bus.recorder.sent)
    assert await bus.produce(body(), headers=None) is Outcome.REFUSED
    assert await bus.produce(body(), headers=bearer("sk-stolen")) is Outcome.REFUSED
    new = bus.recorder.sent[len(before) :]
    assert {topic for topic, _, _ in new} == {TOPICS.dead_letters}
    assert len(new) == 2 and "request id is in use" in bus.dead_letters()[-1].reason


async def test_an_unreadable_record_reusing_a_known_id_is_only_dead_lettered(bus: Bus) -> None:
    assert await bus.produce(body(), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    before = len(bus.recorder.sent)
    forged = body(cache_salt="x")  # unreadable: no chunk may end acme's running stream
    assert await bus.produce(forged, headers=None) is Outcome.REFUSED
    assert {t for t, _, _ in bus.recorder.sent[before:]} == {TOPICS.dead_letters}


async def test_two_tenants_may_use_the_same_request_id_at_once(bus: Bus) -> None:
    acme, beta = body(), body(tenant="beta")
    assert await bus.produce(acme, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    assert await bus.produce(beta, headers=bearer(BETA_KEY), key=b"beta") is Outcome.FORWARDED
    items = bus.forwarded()
    assert sorted(i.tenant_id for i in items) == ["acme", "beta"]
    assert len({i.engine_request_id for i in items}) == 2
    assert bus.dispatcher.metrics.num_duplicates == 0
    # Each tenant's usage and cancel touch its own request only.
    bus.finish("acme", "r1", last_seq=0)
    assert list(bus.dispatcher._in_flight) == [("beta", "r1")]
    await cancel(bus.dispatcher, "acme", "r1")
    assert not bus.dispatcher._in_flight[("beta", "r1")].cancelled
    # acme's id is done; beta's still runs: a copy of each gets its own answer.
    assert await bus.produce(acme, headers=bearer(ACME_KEY)) is Outcome.DUPLICATE
    assert await bus.produce(beta, headers=bearer(BETA_KEY), key=b"beta") is Outcome.DUPLICATE
    assert only(bus.chunks(ACME)).error.code == "duplicate_request"
    assert not bus.chunks(BETA)  # running, same reply topic: nothing more is sent


# -- cancels: the same checks, then on to the workers on the aborts topic ---------------------
@pytest.mark.parametrize(
    ("case", "headers", "fields"),
    [
        ("no credential", None, {}),
        ("another tenant's credential", "beta", {}),
        ("the job's own reason", "acme", {"reason": "reassigned"}),
    ],
)
async def test_a_cancel_that_is_not_its_tenant_s_own_is_dead_lettered_and_goes_nowhere(
    bus: Bus, case: str, headers: str | None, fields: dict[str, Any]
) -> None:
    assert await bus.produce(body("r1"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    from schemas import CancelRequest

    message = CancelRequest(request_id="r1", tenant_id="acme", **fields)
    await bus.dispatcher.handle_cancel(
        Record(
            TOPICS.cancels,
            0,
            7,
            b"acme",
            encode(message),
            service_headers(headers) if headers else None,
        )
    )
    assert TOPICS.aborts not in bus.topics(), case
    assert not bus.dispatcher._in_flight[("acme", "r1")].cancelled
    (letter,) = bus.dead_letters()
    assert letter.source_topic == TOPICS.cancels and letter.offset == 7
    assert letter.reason.startswith("cancel refused")


async def test_a_tenant_s_cancel_of_a_running_request_goes_on_to_the_workers(bus: Bus) -> None:
    assert await bus.produce(body("r1"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    await cancel(bus.dispatcher, "acme", "r1")
    assert bus.dispatcher._in_flight[("acme", "r1")].cancelled
    (sent,) = [value for topic, _, value in bus.recorder.sent if topic == TOPICS.aborts]
    from schemas import CancelRequest

    assert decode(CancelRequest, sent).request_id == "r1"
    assert bus.dead_letters() == []


# -- sizes: what would not fit a record is refused, never retried for good ------------------
async def test_a_request_record_over_the_limit_is_refused_before_it_is_read(
    tmp_path: Path,
) -> None:
    bus = make_bus(tmp_path, {"max_request_record_bytes": 4_096})
    dispatcher = bus.dispatcher
    small = body("r1", prompt="x" * 3_000)
    large = body("r2", prompt="x" * 5_000)
    assert await bus.produce(large, headers=bearer(ACME_KEY)) is Outcome.REFUSED
    chunk = only(bus.chunks(ACME))
    assert (chunk.request_id, chunk.error.code) == ("r2", "request_too_large")
    assert "at most 4096" in chunk.error.message
    letter = only(bus.dead_letters())
    assert letter.reason.startswith("request_too_large: ") and letter.payload_bytes > 4_096
    assert bus.topics() == {ACME, TOPICS.dead_letters}  # not read: no usage, no forward
    loop = asyncio.create_task(dispatcher.run())
    try:
        assert await bus.produce(small, headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


@pytest.mark.parametrize(
    "stop", [["s"] * 17, ["x" * 257]], ids=["17 strings", "a string of 257 characters"]
)
async def test_stop_strings_are_bounded(bus: Bus, stop: list[str]) -> None:
    request = body("r1", sampling={"max_tokens": 8, "stop": stop})
    assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.REFUSED
    assert only(bus.chunks(ACME)).error.code == "invalid_request"
    assert "stop" in only(bus.dead_letters()).reason
    assert WORKER not in bus.topics()


class RecordLimit(Recorder):
    """A publisher that refuses records over ``limit`` bytes to the worker's topic, as
    aiokafka's producer refuses those over its ``max_request_size``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.num_refused = 0

    async def __call__(self, topic: str, key: bytes, value: bytes, headers: Any = None) -> Any:
        if topic == WORKER and len(value) > self.limit:
            self.num_refused += 1
            raise MessageSizeTooLargeError(f"{len(value)} bytes")
        return await super().__call__(topic, key, value, headers)


async def test_a_forward_too_large_to_send_is_answered_not_retried(tmp_path: Path) -> None:
    recorder = RecordLimit(limit=2_000)
    bus = make_bus(tmp_path, recorder=recorder)
    dispatcher = bus.dispatcher
    loop = asyncio.create_task(dispatcher.run())
    try:
        request = body("r1", prompt="x" * 1_900)  # under 2,000 bytes, its forward over
        assert await bus.produce(request, headers=bearer(ACME_KEY)) is Outcome.REFUSED
        chunk = only(bus.chunks(ACME))
        assert chunk.error.code == "request_too_large" and chunk.finish_reason == "rejected"
        usage = only(bus.usage())
        assert (usage.status, usage.error_code) == ("rejected", "request_too_large")
        assert recorder.num_refused == 1
        assert dispatcher.metrics.num_forward_retries == 0
        assert ("acme", "r1") not in dispatcher._in_flight
        # Refused: the window keeps none of its tokens, once its own row is read too.
        assert dispatcher._store.load("acme").used()[0] == 0
        dispatcher.observe_usage(encode(usage))
        assert dispatcher._store.load("acme").used()[0] == 0
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


@pytest.mark.parametrize(
    "fields",
    [{"reason": "x" * 500_000}, {"request_id": "r1/../x"}, {"tenant_id": "acme.eu"}],
    ids=["a long reason", "a request id of no id's shape", "a tenant id of no tenant's shape"],
)
async def test_a_cancel_out_of_bounds_is_dead_lettered_whole(
    bus: Bus, fields: dict[str, Any]
) -> None:
    assert await bus.produce(body("r1"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    value = orjson.dumps({"request_id": "r1", "tenant_id": "acme", **fields})
    record = Record(TOPICS.cancels, 0, 9, b"acme", value, bearer(ACME_KEY))
    await bus.dispatcher.handle_cancel(record)
    (letter,) = bus.dead_letters()
    assert letter.reason.startswith("cancel refused") and letter.payload_bytes == len(value)
    assert len(bus.recorder.on(TOPICS.dead_letters)[0]) < 1_000_000
    assert TOPICS.aborts not in bus.topics()
    assert not bus.dispatcher._in_flight[("acme", "r1")].cancelled


# -- partitions: a tenant's records belong on its key's partition ----------------------------
@pytest.mark.parametrize("partition", [1, 2, 3])
async def test_a_record_off_its_key_s_partition_is_refused_and_writes_nothing(
    tmp_path: Path, partition: int
) -> None:
    home_of = functools.partial(key_partition, num_partitions=4)
    assert home_of(b"acme") == 0
    bus = make_bus(tmp_path, home_of=home_of)
    dispatcher, recorder = bus.dispatcher, bus.recorder
    loop = asyncio.create_task(dispatcher.run())
    try:
        request = orjson.dumps(body("r1"))
        # Another job instance may hold partition ``partition``: admitted there too, the
        # id would run twice, on two quotas.
        off = Record("p", partition, 0, b"acme", request, bearer(ACME_KEY))
        assert await dispatcher.handle_request(off) is Outcome.REFUSED
        chunk = only(recorder.chunks_on(ACME))
        assert chunk.error.code == "invalid_partition"
        assert "partition 0 (Kafka's default partitioner" in chunk.error.message
        letter = only([decode(DeadLetter, v) for v in recorder.on(TOPICS.dead_letters)])
        assert letter.reason.startswith("invalid_partition: ") and letter.partition == partition
        assert {topic for topic, _, _ in recorder.sent} == {ACME, TOPICS.dead_letters}
        assert dispatcher._store.load("acme").used() == (0, 0)
        # The same record where its key puts it is served: the id was left free.
        home = Record("p", 0, 1, b"acme", request, bearer(ACME_KEY))
        assert await asyncio.wait_for(dispatcher.handle_request(home), 2) is Outcome.FORWARDED
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


@pytest.mark.parametrize("num_partitions", [1, 4, 12, 64])
def test_a_key_s_partition_is_the_default_partitioner_s(num_partitions: int) -> None:
    every = list(range(num_partitions))
    for n in range(200):
        key = f"tenant-{n}".encode()
        assert key_partition(key, num_partitions) == DefaultPartitioner()(key, every, every)


# -- reply topics a refusal nobody proved may go to ------------------------------------------
@pytest.mark.parametrize("record", ["no credential", "unreadable"])
async def test_a_refusal_nobody_proved_goes_only_to_a_reply_topic_the_job_knows(
    tmp_path: Path, record: str
) -> None:
    # Asking the broker about a new topic would make it (Kafka's default) or wait for it,
    # holding an admission slot: neither for a producer nobody identified.
    async def knows_topic(topic: str, *, assume_on_failure: bool = False) -> bool:
        return topic == ACME

    bus = make_bus(tmp_path, knows_topic=knows_topic)
    recorder = bus.recorder
    ghost = reply_topic("acme").replace("acme.", "acme.ghost-")
    for n, reply_to in enumerate([ghost, ACME]):
        value = body(f"r{n}", reply_to=reply_to)
        if record == "unreadable":
            value["sampling"] = {"max_tokens": -1}
        assert await bus.produce(value, headers=None) is Outcome.REFUSED
    assert {topic for topic, _, _ in recorder.sent} == {ACME, TOPICS.dead_letters}
    assert only(bus.chunks(ACME)).request_id == "r1"
    ghostly, answered = bus.dead_letters()
    assert ghostly.reason.endswith("(not answered: no such topic)")
    assert not answered.reason.endswith(")") and not answered.reason.startswith("None")


# -- what the fleet and the cancels may say ---------------------------------------------------
@pytest.mark.parametrize(
    "topic", [ACME, "tokenbus.usage", "tokenbus.worker.other"], ids=["reply", "usage", "another"]
)
async def test_a_heartbeat_naming_a_topic_not_its_worker_s_is_ignored(bus: Bus, topic: str) -> None:
    # The job forwards prompts where a heartbeat says: only ever to the worker's own topic.
    rogue = WorkerStatus(
        worker_id="w2", model="m", request_topic=topic, max_num_seqs=64, incarnation="x"
    )
    bus.dispatcher.observe_heartbeat(encode(rogue))
    for n in range(3):  # a worker with 64 free seats would be chosen over one with 8
        assert await bus.produce(body(f"r{n}"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    assert {i.worker_id for i in bus.forwarded()} == {"w"}
    assert topic not in bus.topics()


async def test_an_abort_is_keyed_by_its_tenant_not_by_the_cancel_s_key(bus: Bus) -> None:
    assert await bus.produce(body("r1"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    value = orjson.dumps({"request_id": "r1", "tenant_id": "acme"})
    await bus.dispatcher.handle_cancel(
        Record(TOPICS.cancels, 0, 1, b"acme" * 1000, value, bearer(ACME_KEY))
    )
    [(key, _)] = [(k, v) for t, k, v in bus.recorder.sent if t == TOPICS.aborts]
    assert key == b"acme"


@pytest.mark.parametrize("field", ["max_num_seqs", "num_running", "num_waiting", "max_loras"])
def test_a_heartbeat_with_a_negative_count_is_ignored(field: str) -> None:
    good = WorkerStatus(worker_id="w2", model="m", request_topic="tokenbus.worker.w2")
    raw = orjson.loads(encode(good)) | {field: -1}
    with pytest.raises(SchemaError, match=field):
        decode(WorkerStatus, orjson.dumps(raw))


# -- a tenant's reply topic must exist ----------------------------------------------------------
class Topics:
    """The broker's topics as the job may look them up, and the lookups that would take
    a topic as there should the broker not answer."""

    def __init__(self, *existing: str) -> None:
        self.existing = set(existing)
        self.assumed: list[str] = []

    async def __call__(self, topic: str, *, assume_on_failure: bool = False) -> bool:
        if assume_on_failure:
            self.assumed.append(topic)
        return topic in self.existing


async def test_a_request_whose_reply_topic_does_not_exist_is_dead_lettered_and_may_come_again(
    tmp_path: Path,
) -> None:
    # Its tokens would make the topic (a broker that makes topics on demand: a topic per
    # fresh name a tenant sends) or wait for it; refused before the tenant's state is
    # touched, so the same request runs once its producer has made the topic.
    topics = Topics()
    bus = make_bus(tmp_path, knows_topic=topics)
    assert await bus.produce(body("r1"), headers=bearer(ACME_KEY)) is Outcome.REFUSED
    assert bus.topics() == {TOPICS.dead_letters}
    letter = only(bus.dead_letters())
    assert letter.reason.startswith("reply_topic_missing:") and ACME in letter.reason
    assert topics.assumed == [ACME]  # a tenant's request: not refused for the broker
    assert bus.dispatcher.metrics.num_reply_topic_missing == 1

    topics.existing.add(ACME)
    loop = asyncio.create_task(bus.dispatcher.run())
    try:
        assert await bus.produce(body("r1"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    finally:
        loop.cancel()
    assert [item.request_id for item in bus.forwarded()] == ["r1"]
    assert bus.usage() == [] and bus.chunks(ACME) == []


async def test_a_copy_naming_a_missing_reply_topic_leaves_the_run_alone(bus: Bus) -> None:
    # A rejected usage row under a running request's id would settle its reservations to
    # nothing and take its billing key: the run would go unbilled.
    assert await bus.produce(body("r1"), headers=bearer(ACME_KEY)) is Outcome.FORWARDED
    topics = Topics(ACME)
    bus.dispatcher._knows_topic = topics
    ghost = ACME.replace("acme.", "acme.ghost-")
    copy = body("r1", reply_to=ghost)
    assert await bus.produce(copy, headers=bearer(ACME_KEY)) is Outcome.REFUSED
    assert only(bus.dead_letters()).reason.startswith("reply_topic_missing:")
    assert bus.usage() == [] and ghost not in bus.topics()
    entry = bus.dispatcher._ledger.get("acme", "r1")
    assert entry is not None and entry.state is State.FORWARDED
    bus.finish("acme", "r1", last_seq=3)  # the run's own usage settles it
    ended = bus.dispatcher._ledger.get("acme", "r1")
    assert ended is not None and ended.state is State.DONE


async def test_a_misplaced_request_is_not_answered_on_a_reply_topic_that_does_not_exist(
    tmp_path: Path,
) -> None:
    bus = make_bus(tmp_path, knows_topic=Topics())
    refused = await bus.produce(body("r1"), headers=bearer(ACME_KEY), key=b"beta")
    assert refused is Outcome.REFUSED
    assert bus.topics() == {TOPICS.dead_letters}
    assert only(bus.dead_letters()).reason.startswith("invalid_key:")
