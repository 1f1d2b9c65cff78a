"""Hostile producers on the Kafka entry, on the real stack (issue 15).

Each case writes raw records with aiokafka, as any program may, and checks three things:
what the producer gets back on its reply topic, what the dead-letter topic holds, and
what ClickHouse bills. Producers authenticate with their tenant's API key
(``bus_key``) or a JWT in the record's ``authorization`` header.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import jsonschema
import jwt
import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from billing.reader import open_reader
from producers import TokenbusClient
from schemas import (
    INTERNAL_FIELDS,
    DeadLetter,
    InferenceRequest,
    SamplingParams,
    decode,
)
from schemas.export import schema_path
from stream_jobs.ledger import MAX_COPIES
from tests.integration.conftest import BUS_JWT_SECRET, bus_key, eventually
from tokenbus.chunks import Chunk, decode_batch
from tokenbus.config import Settings
from tokenbus.ids import new_request_id
from tokenbus.kafka import (
    ensure_topics,
    key_partition,
    make_consumer,
    make_producer,
    topic_names,
)
from tokenbus.topics import Topics
from tokenbus_cli.stack import Stack

A, B = "trust-a", "trust-b"
CACHE_PROMPT = "The quarterly report of the tenant says: " + "revenue grew in every region. " * 12


def body(reply_to: str, **fields: Any) -> dict[str, Any]:
    return {
        "request_id": new_request_id(),
        "model": "tiny-llama",
        "prompt": "hello there",
        "sampling": {"max_tokens": 4, "ignore_eos": True},
        "reply_to": reply_to,
        **fields,
    }


def bearer(token: str) -> list[tuple[str, bytes]]:
    return [("authorization", f"Bearer {token}".encode())]


def tenant_jwt(tenant: str, **claims: Any) -> str:
    payload = {"tenant": tenant, "aud": "tokenbus", "exp": int(time.time()) + 300, **claims}
    return jwt.encode(payload, BUS_JWT_SECRET, algorithm="HS256")


async def produce(
    settings: Settings,
    value: dict[str, Any] | bytes,
    *,
    key: str | None,
    headers: list[tuple[str, bytes]] | None = None,
    priority: int = 1,
    times: int = 1,
    partition: int | None = None,
) -> None:
    raw = value if isinstance(value, bytes) else orjson.dumps(value)
    producer = make_producer(settings)
    await producer.start()
    try:
        for _ in range(times):
            await producer.send_and_wait(
                Topics(settings.topic_prefix).requests(priority),
                raw,
                key=key.encode() if key is not None else None,
                headers=headers or [],
                partition=partition,
            )
    finally:
        await producer.stop()


class Tap:
    """Reads one topic from its end at creation: what arrives later, decoded."""

    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer
        self.records: list[bytes] = []

    async def drain(self, seconds: float) -> list[bytes]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            batches = await self._consumer.getmany(timeout_ms=200)
            for records in batches.values():
                self.records += (r.value for r in records if r.value is not None)
        return self.records


async def tap(settings: Settings, topic: str) -> AsyncIterator[Tap]:
    consumer = make_consumer(settings, group_id=None, auto_offset_reset="latest")
    await consumer.start()
    try:
        await consumer.topics()
        partitions = consumer.partitions_for_topic(topic) or {0}
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)
        yield Tap(consumer)
    finally:
        await consumer.stop()


@pytest.fixture
async def dlq(settings: Settings) -> AsyncIterator[Tap]:
    async for t in tap(settings, Topics(settings.topic_prefix).dead_letters):
        yield t


@pytest.fixture
async def listener(settings: Settings) -> AsyncIterator[TokenbusClient]:
    """Tenant A's own client: its reply topic is one A's key owns."""
    async with TokenbusClient(settings, tenant_id=A, credential=bus_key(A)) as client:
        yield client


def letters_about(tap: Tap, request_id: str) -> list[DeadLetter]:
    letters = [decode(DeadLetter, raw) for raw in tap.records]
    return [letter for letter in letters if request_id in letter.payload]


async def dead_letters(tap: Tap, request_id: str, timeout_s: float = 30) -> list[DeadLetter]:
    """The dead letters about ``request_id``, once there is at least one."""
    deadline = time.monotonic() + timeout_s
    while not letters_about(tap, request_id):
        assert time.monotonic() < deadline, f"no dead letter about {request_id}"
        await tap.drain(0.3)
    await tap.drain(0.5)  # and any that follow at once
    return letters_about(tap, request_id)


async def answer(client: TokenbusClient, request_id: str, tenant: str) -> list[Chunk]:
    request = InferenceRequest(
        request_id=request_id, tenant_id=tenant, model="m", prompt="x", reply_to="r"
    )
    return [chunk async for chunk in client.stream(request)]


def billing_rows(settings: Settings, request_id: str) -> list[dict[str, Any]]:
    return open_reader(settings).query(
        "SELECT tenant_id, status, error_code, prompt_tokens, completion_tokens, "
        "cached_tokens, created_at, price_version, cost_units, billed_units "
        "FROM usage_events FINAL WHERE request_id = {rid:String}",
        {"rid": request_id},
    )


async def refused_unproven(
    client: TokenbusClient,
    dlq: Tap,
    settings: Settings,
    value: dict[str, Any],
    *,
    key: str | None,
    headers: list[tuple[str, bytes]] | None,
    tenant: str,
) -> tuple[Chunk, list[DeadLetter]]:
    """Produces ``value`` with no credential that proves its tenant; returns the one
    chunk its producer got, and the dead letters about it."""
    client.watch(value["request_id"], tenant)
    await produce(settings, value, key=key, headers=headers)
    chunks = await asyncio.wait_for(answer(client, value["request_id"], tenant), 30)
    assert len(chunks) == 1, chunks
    return chunks[0], await dead_letters(dlq, value["request_id"])


# -- credentials -------------------------------------------------------------------------------
async def test_another_tenant_s_id_without_a_credential_leaves_its_real_request_whole(
    settings: Settings, listener: TokenbusClient, dlq: Tap
) -> None:
    value = body(listener.reply_topic, tenant_id=A)
    chunk, letters = await refused_unproven(
        listener, dlq, settings, value, key=A, headers=None, tenant=A
    )
    assert chunk.error is not None and chunk.error.code == "missing_credential"
    assert [letter.reason.split(":")[0] for letter in letters] == ["missing_credential"]

    # The same id, then sent by the tenant itself: the refusal above wrote nothing of
    # A's (no usage row to settle this run's reservation, nor take its billing key), so
    # it runs and is billed once, as itself.
    listener.watch(value["request_id"], A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)))
    chunks = await asyncio.wait_for(answer(listener, value["request_id"], A), 60)
    assert chunks[-1].error is None and sum(c.num_tokens for c in chunks) == 4
    rows = await eventually(lambda: billing_rows(settings, value["request_id"]))
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [("ok", 4)]


async def to_missing_topics(
    settings: Settings, dlq: Tap, num: int, *, headers: list[tuple[str, bytes]] | None
) -> tuple[list[dict[str, Any]], list[DeadLetter]]:
    """``num`` requests of A's, each naming a reply topic of A's that does not exist;
    returns them and the one dead letter each got, once no topic was made for them."""
    topics = Topics(settings.topic_prefix)
    ghosts = [topics.replies(f"{A}.ghost-{new_request_id().lower()}") for _ in range(num)]
    values = [body(ghost, tenant_id=A) for ghost in ghosts]
    for value in values:
        await produce(settings, value, key=A, headers=headers)
    letters = [
        letter for value in values for letter in await dead_letters(dlq, value["request_id"])
    ]
    assert len(letters) == num, letters
    assert not set(ghosts) & await topic_names(settings)
    return values, letters


async def test_a_producer_nobody_proved_cannot_make_the_job_create_topics(
    settings: Settings, dlq: Tap
) -> None:
    # A send to a missing topic makes it on a broker that makes topics on demand (the
    # bundled one; Kafka's default), and waits for it on one that does not.
    _, letters = await to_missing_topics(settings, dlq, 20, headers=None)
    assert all(letter.reason.endswith("(not answered: no such topic)") for letter in letters)


async def test_a_tenant_cannot_make_topics_with_fresh_reply_names(
    settings: Settings, dlq: Tap
) -> None:
    # Each fresh name under the tenant's own prefix would be a topic, made by the
    # worker's tokens (or by an answer): refused before it runs, with nothing billed, and
    # run as it was once the tenant has made its topic.
    values, letters = await to_missing_topics(settings, dlq, 10, headers=bearer(bus_key(A)))
    assert all(letter.reason.startswith("reply_topic_missing:") for letter in letters)
    ghosts = [value["reply_to"] for value in values]

    await ensure_topics(settings, {ghosts[0]: 1})
    rid = values[0]["request_id"]
    await produce(settings, values[0], key=A, headers=bearer(bus_key(A)))
    rows = await eventually(lambda: billing_rows(settings, rid))
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [("ok", 4)]
    chunks = await read_reply_topic(settings, ghosts[0], rid)
    assert sum(c.num_tokens for c in chunks) == 4 and chunks[-1].error is None
    # Keyed alike, so on the usage topic's same partition: any row for the refused
    # requests would have come before the run's.
    assert billing_rows(settings, values[1]["request_id"]) == []


async def test_a_tenant_nobody_configured_is_not_served_on_default_quota(
    settings: Settings, listener: TokenbusClient, dlq: Tap
) -> None:
    # No credential can prove "nobody-configured-this": no key exists for it.
    value = body(listener.reply_topic, tenant_id="nobody-configured-this")
    chunk, letters = await refused_unproven(
        listener,
        dlq,
        settings,
        value,
        key="nobody-configured-this",
        headers=bearer("sk-guess"),
        tenant="nobody-configured-this",
    )
    assert chunk.error is not None and chunk.error.code == "invalid_api_key"
    assert [letter.reason.split(":")[0] for letter in letters] == ["invalid_api_key"]


@pytest.mark.parametrize(
    ("token", "code"),
    [
        ("forged", "invalid_credential"),
        ("expired", "token_expired"),
        ("alg-none", "invalid_credential"),
        ("other-audience", "invalid_credential"),
    ],
)
async def test_forged_and_expired_tokens_are_refused(
    settings: Settings, listener: TokenbusClient, dlq: Tap, token: str, code: str
) -> None:
    claims = {"tenant": A, "aud": "tokenbus", "exp": int(time.time()) + 300}
    tokens = {
        "forged": jwt.encode(claims, "not-the-secret-but-long-enough-0123456789", "HS256"),
        "expired": jwt.encode({**claims, "exp": int(time.time()) - 600}, BUS_JWT_SECRET, "HS256"),
        "alg-none": jwt.encode(claims, "", "none"),
        "other-audience": jwt.encode({**claims, "aud": "elsewhere"}, BUS_JWT_SECRET, "HS256"),
    }
    value = body(listener.reply_topic, tenant_id=A)
    chunk, letters = await refused_unproven(
        listener, dlq, settings, value, key=A, headers=bearer(tokens[token]), tenant=A
    )
    assert chunk.error is not None and chunk.error.code == code
    assert [letter.reason.split(":")[0] for letter in letters] == [code]


async def test_a_valid_tenant_jwt_is_served(settings: Settings, listener: TokenbusClient) -> None:
    value = body(listener.reply_topic, tenant_id=A)
    listener.watch(value["request_id"], A)
    await produce(settings, value, key=A, headers=bearer(tenant_jwt(A)))
    chunks = await asyncio.wait_for(answer(listener, value["request_id"], A), 60)
    assert chunks[-1].error is None and sum(c.num_tokens for c in chunks) == 4


async def test_a_key_of_tenant_a_cannot_claim_tenant_b(
    settings: Settings, listener: TokenbusClient, dlq: Tap
) -> None:
    for key in (A, B):  # on A's partition, and on B's
        value = body(listener.reply_topic, tenant_id=B)
        listener.watch(value["request_id"], A)
        await produce(settings, value, key=key, headers=bearer(bus_key(A)))
        chunks = await asyncio.wait_for(answer(listener, value["request_id"], A), 30)
        assert [c.error.code for c in chunks if c.error] == ["tenant_mismatch"]
        await asyncio.sleep(1.5)  # the sink's batch interval
        rows = billing_rows(settings, value["request_id"])
        # Never B's; A's rejected row only where A's partition could keep the id's answer.
        expected = [(A, "rejected")] if key == A else []
        assert [(r["tenant_id"], r["status"]) for r in rows] == expected


async def test_a_record_keyed_by_another_tenant_is_refused_and_may_be_sent_again(
    settings: Settings, listener: TokenbusClient, dlq: Tap
) -> None:
    value = body(listener.reply_topic)
    listener.watch(value["request_id"], A)
    await produce(settings, value, key=B, headers=bearer(bus_key(A)))
    (chunk,) = await asyncio.wait_for(answer(listener, value["request_id"], A), 30)
    assert chunk.error is not None and chunk.error.code == "invalid_key"
    (letter,) = await dead_letters(dlq, value["request_id"])
    assert letter.reason.startswith("invalid_key")
    # Nothing was kept of it: keyed right, the same request runs, and is billed once.
    listener.watch(value["request_id"], A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)))
    chunks = await asyncio.wait_for(answer(listener, value["request_id"], A), 60)
    assert chunks[-1].error is None and sum(c.num_tokens for c in chunks) == 4
    rows = await eventually(lambda: billing_rows(settings, value["request_id"]))
    assert [(r["tenant_id"], r["status"]) for r in rows] == [(A, "ok")]


async def test_a_record_off_its_key_s_partition_is_refused_and_may_be_sent_again(
    settings: Settings, listener: TokenbusClient, dlq: Tap
) -> None:
    # With several job instances, another may hold that partition: admitted on both, the
    # id would run twice, on two quotas. A producer may name any partition; the job
    # refuses one its key does not hash to.
    home = key_partition(A.encode(), settings.num_partitions)
    value = body(listener.reply_topic)
    listener.watch(value["request_id"], A)
    elsewhere = (home + 1) % settings.num_partitions
    await produce(settings, value, key=A, headers=bearer(bus_key(A)), partition=elsewhere)
    (chunk,) = await asyncio.wait_for(answer(listener, value["request_id"], A), 30)
    assert chunk.error is not None and chunk.error.code == "invalid_partition"
    assert f"belong on partition {home} " in chunk.error.message
    (letter,) = await dead_letters(dlq, value["request_id"])
    assert letter.reason.startswith("invalid_partition") and letter.partition == elsewhere
    listener.watch(value["request_id"], A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)), partition=home)
    chunks = await asyncio.wait_for(answer(listener, value["request_id"], A), 60)
    assert chunks[-1].error is None and sum(c.num_tokens for c in chunks) == 4
    rows = await eventually(lambda: billing_rows(settings, value["request_id"]))
    assert [(r["tenant_id"], r["status"]) for r in rows] == [(A, "ok")]


# -- fields tokenbus derives ---------------------------------------------------------------------
INTERNAL_VALUES: dict[str, Any] = {
    "attempt": 5,
    "worker_id": "worker-0",
    "worker_incarnation": "x",
    "dispatched_at": "2026-01-01T00:00:00Z",
    "admitted_at": "2026-01-01T00:00:00Z",
    "resume_token_ids": [1, 2, 3],
    "resume_seq": 3,
    "overload_tier": 0,
    "cache_salt": "group:docs",
    "flags": ["injection_suspected"],
    "key_sha256": "0" * 64,
    "adapter": {"name": "trust-a-adapter", "path": "/etc/passwd", "lora_int_id": 7},
}


@pytest.mark.parametrize("field", sorted(INTERNAL_FIELDS))
async def test_an_internal_field_is_refused_with_its_name(
    settings: Settings, listener: TokenbusClient, dlq: Tap, field: str
) -> None:
    value = body(listener.reply_topic, tenant_id=A, **{field: INTERNAL_VALUES[field]})
    listener.watch(value["request_id"], A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)))
    chunks = await asyncio.wait_for(answer(listener, value["request_id"], A), 30)
    assert [c.error.code for c in chunks if c.error] == ["invalid_request"]
    assert chunks[0].error is not None and field in chunks[0].error.message
    (letter,) = await dead_letters(dlq, value["request_id"])
    assert f"{field}: set by tokenbus" in letter.reason
    await asyncio.sleep(1.5)  # the sink's batch interval: nothing was billed
    assert billing_rows(settings, value["request_id"]) == []


async def test_neither_prompt_nor_messages_is_refused_and_the_schema_says_so(
    settings: Settings, listener: TokenbusClient, dlq: Tap
) -> None:
    value = body(listener.reply_topic, tenant_id=A)
    del value["prompt"]
    schema = orjson.loads(schema_path(InferenceRequest).read_bytes())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(value, schema)
    jsonschema.validate({**value, "prompt": "hi"}, schema)  # exactly one: accepted
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {**value, "prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, schema
        )

    listener.watch(value["request_id"], A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)))
    chunks = await asyncio.wait_for(answer(listener, value["request_id"], A), 30)
    assert chunks[0].error is not None and "exactly one of" in chunks[0].error.message


async def test_a_producer_s_created_at_does_not_set_the_price(
    settings: Settings, listener: TokenbusClient
) -> None:
    value = body(listener.reply_topic, tenant_id=A, created_at="2001-01-01T00:00:00Z")
    listener.watch(value["request_id"], A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)))
    chunks = await asyncio.wait_for(answer(listener, value["request_id"], A), 60)
    assert chunks[-1].error is None
    (row,) = await eventually(lambda: billing_rows(settings, value["request_id"]))
    assert row["status"] == "ok" and row["completion_tokens"] == 4
    admitted = datetime.fromisoformat(row["created_at"])
    assert abs(admitted.timestamp() - time.time()) < 600  # admission, not 2001
    assert row["price_version"] >= 1
    assert float(row["cost_units"]) > 0 and float(row["billed_units"]) > 0


async def test_a_priority_above_the_tenant_s_class_is_clamped(
    settings: Settings, listener: TokenbusClient
) -> None:
    value = body(listener.reply_topic, tenant_id=A, priority=0)
    listener.watch(value["request_id"], A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)), priority=0)
    await asyncio.wait_for(answer(listener, value["request_id"], A), 60)
    rows = await eventually(
        lambda: open_reader(settings).query(
            "SELECT priority FROM usage_events FINAL WHERE request_id = {rid:String}",
            {"rid": value["request_id"]},
        )
    )
    assert [r["priority"] for r in rows] == [1]


async def test_a_batch_id_does_not_buy_the_batch_price_for_interactive_work(
    settings: Settings, listener: TokenbusClient
) -> None:
    """A batch id is for class 2 lines: at priority 1 the request is refused, and billed
    nothing; the same at priority 2 runs as a batch line, priced as one."""
    batch = new_request_id()
    interactive = body(listener.reply_topic, tenant_id=A, priority=1, batch_id=batch)
    line = body(listener.reply_topic, tenant_id=A, priority=2, batch_id=batch)
    for value, priority in ((interactive, 1), (line, 2)):
        listener.watch(value["request_id"], A)
        await produce(settings, value, key=A, headers=bearer(bus_key(A)), priority=priority)

    [refusal] = await asyncio.wait_for(answer(listener, interactive["request_id"], A), 30)
    assert refusal.error is not None and refusal.error.code == "invalid_request"
    assert "batch_id is for batch lines, which run at priority 2" in refusal.error.message
    ran = await asyncio.wait_for(answer(listener, line["request_id"], A), 60)
    assert ran[-1].error is None
    [rejected] = await eventually(lambda: billing_rows(settings, interactive["request_id"]))
    assert (rejected["status"], rejected["error_code"]) == ("rejected", "invalid_request")
    assert float(rejected["billed_units"]) == 0
    [row] = await eventually(lambda: billing_rows(settings, line["request_id"]))
    assert row["status"] == "ok" and float(row["billed_units"]) > 0
    batch_ids = open_reader(settings).query(
        "SELECT request_id, batch_id, priority FROM usage_events FINAL"
        " WHERE tenant_id = {tenant:String} AND batch_id = {batch:String} ORDER BY priority",
        {"tenant": A, "batch": batch},
    )
    assert [(r["request_id"], r["priority"]) for r in batch_ids] == [
        (interactive["request_id"], 1),
        (line["request_id"], 2),
    ]


# -- replies go only where they belong -----------------------------------------------------------
async def test_reply_to_the_heartbeats_topic_is_refused_and_nothing_is_written_there(
    settings: Settings, dlq: Tap
) -> None:
    heartbeats = Topics(settings.topic_prefix).heartbeats
    value = body(heartbeats, tenant_id=A)
    async for beats in tap(settings, heartbeats):
        await produce(settings, value, key=A, headers=bearer(bus_key(A)))
        (letter,) = await dead_letters(dlq, value["request_id"])
        assert "is not a reply topic of this credential" in letter.reason
        for raw in await beats.drain(2.0):
            assert value["request_id"].encode() not in raw  # heartbeats only
    rows = await eventually(lambda: billing_rows(settings, value["request_id"]))
    assert [(r["status"], r["error_code"]) for r in rows] == [("rejected", "reply_topic_forbidden")]


async def test_another_tenant_cannot_aim_at_a_stream_in_flight(
    settings: Settings, listener: TokenbusClient, dlq: Tap
) -> None:
    """B reuses A's in-flight request id and aims at A's reply topic, with B's key, with
    no key while claiming A, and with a JWT for A whose reply_prefix is B's: A's client
    sees exactly its own tokens."""
    request = await listener.submit(
        prompt="a long answer please",
        sampling=SamplingParams(max_tokens=400, ignore_eos=True),
        priority=1,
    )
    rid = request.request_id
    hijack = body(listener.reply_topic, request_id=rid, tenant_id=A)
    hijack["sampling"] = {"max_tokens": 3, "ignore_eos": True}
    await produce(settings, {**hijack, "tenant_id": B}, key=B, headers=bearer(bus_key(B)))
    await produce(
        settings,
        {k: v for k, v in hijack.items() if k != "tenant_id"},
        key=B,
        headers=bearer(bus_key(B)),
    )
    await produce(settings, hijack, key=A, headers=None)  # unproven, and the id is in use
    foreign_prefix = Topics(settings.topic_prefix).replies(f"{B}.")
    await produce(
        settings, hijack, key=A, headers=bearer(tenant_jwt(A, reply_prefix=foreign_prefix))
    )
    chunks = [chunk async for chunk in listener.stream(request)]

    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].error is None
    assert sum(c.num_tokens for c in chunks) == 400
    await asyncio.sleep(2.0)  # the sink's batch interval: every row is in
    rows = await eventually(lambda: billing_rows(settings, rid), until=lambda r: len(r) >= 2)
    # A's one run; B's first copy refused (its id then answered, the second a repeat);
    # the copies under A's name never touch A's row.
    assert sorted((r["tenant_id"], r["status"], r["completion_tokens"]) for r in rows) == [
        (A, "ok", 400),
        (B, "rejected", 0),
    ]
    await dlq.drain(1.0)
    reasons = [letter.reason for letter in letters_about(dlq, rid)]
    assert any("not a reply topic of this credential" in reason for reason in reasons)
    assert any("request id is in use" in reason for reason in reasons)


# -- one request id, one run ---------------------------------------------------------------------
async def read_reply_topic(settings: Settings, topic: str, request_id: str) -> list[Chunk]:
    consumer = make_consumer(settings, topic, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    chunks: list[Chunk] = []
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=300)
            for records in batches.values():
                for record in records:
                    batch = decode_batch(record.value)  # as the client reads it
                    chunks += (c for c in batch.chunks if c.request_id == request_id)
    finally:
        await consumer.stop()
    return chunks


async def test_the_same_request_three_times_runs_once(
    settings: Settings, listener: TokenbusClient
) -> None:
    value = body(listener.reply_topic, tenant_id=A)
    value["sampling"] = {"max_tokens": 60, "ignore_eos": True}
    rid = value["request_id"]
    usage = Topics(settings.topic_prefix).usage
    async for usage_tap in tap(settings, usage):
        listener.watch(rid, A)
        # Twice while it runs, as a retrying producer without idempotence would.
        await produce(settings, value, key=A, headers=bearer(bus_key(A)), times=2)
        chunks = await asyncio.wait_for(answer(listener, rid, A), 60)
        assert chunks[-1].error is None and sum(c.num_tokens for c in chunks) == 60
        # Once more after it finished (at once: before the job may have heard it ended).
        await produce(settings, value, key=A, headers=bearer(bus_key(A)))
        deadline = time.monotonic() + 30
        while True:  # each copy answered, never silence, never a second run
            on_topic = await read_reply_topic(settings, listener.reply_topic, rid)
            if len(on_topic) >= len(chunks) + 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        events = [raw for raw in await usage_tap.drain(2.0) if rid.encode() in raw]
        assert len(events) == 1, events
    seqs = [c.seq for c in on_topic]
    assert seqs == list(range(len(seqs))), "a repeated or missing seq"
    assert on_topic[: len(chunks)] == chunks  # the one stream, then one answer per copy
    copies = on_topic[len(chunks) :]
    assert [c.error and c.error.code for c in copies] == ["duplicate_request"] * 2
    rows = await eventually(lambda: billing_rows(settings, rid))
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [("ok", 60)]


async def test_a_flood_of_copies_of_a_running_request_is_answered_up_to_a_bound(
    settings: Settings, listener: TokenbusClient, dlq: Tap
) -> None:
    """A copy costs its producer no quota: past ``MAX_COPIES`` of one running request,
    copies are dead-lettered, and the ones before are answered after the stream."""
    value = body(listener.reply_topic, tenant_id=A)
    value["sampling"] = {"max_tokens": 1000, "ignore_eos": True}  # runs while they arrive
    rid = value["request_id"]
    listener.watch(rid, A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)), times=1 + MAX_COPIES + 3)
    chunks = await asyncio.wait_for(answer(listener, rid, A), 120)
    assert chunks[-1].error is None and sum(c.num_tokens for c in chunks) == 1000
    letters = await dead_letters(dlq, rid)
    assert len(letters) == 3, [letter.reason for letter in letters]
    assert all(f"more than {MAX_COPIES} copies" in letter.reason for letter in letters)
    deadline = time.monotonic() + 30
    while True:
        on_topic = await read_reply_topic(settings, listener.reply_topic, rid)
        if len(on_topic) >= len(chunks) + MAX_COPIES or time.monotonic() > deadline:
            break
    assert on_topic[: len(chunks)] == chunks
    copies = on_topic[len(chunks) :]
    assert [c.seq for c in copies] == list(range(len(chunks), len(chunks) + MAX_COPIES))
    assert {c.error and c.error.code for c in copies} == {"duplicate_request"}
    rows = await eventually(lambda: billing_rows(settings, rid))
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [("ok", 1000)]


# -- the prefix cache ------------------------------------------------------------------------------
async def test_a_producer_cannot_choose_its_cache_salt(
    settings: Settings, listener: TokenbusClient
) -> None:
    first = await listener.submit(prompt=CACHE_PROMPT, sampling=SamplingParams(max_tokens=2))
    [_ async for _ in listener.stream(first)]
    second = await listener.submit(prompt=CACHE_PROMPT, sampling=SamplingParams(max_tokens=2))
    [_ async for _ in listener.stream(second)]
    async with TokenbusClient(settings, tenant_id=B, credential=bus_key(B)) as thief:
        # With A's salt written into the record: refused before it reaches the engine.
        salted = body(thief.reply_topic, tenant_id=B, prompt=CACHE_PROMPT, cache_salt=A)
        thief.watch(salted["request_id"], B)
        await produce(settings, salted, key=B, headers=bearer(bus_key(B)))
        (refused,) = await asyncio.wait_for(answer(thief, salted["request_id"], B), 30)
        assert refused.error is not None and "cache_salt" in refused.error.message
        # As B may: its own salt, so none of A's cache.
        stolen = await thief.submit(prompt=CACHE_PROMPT, sampling=SamplingParams(max_tokens=2))
        [_ async for _ in thief.stream(stolen)]
    rows = await eventually(
        lambda: (
            billing_rows(settings, second.request_id) + billing_rows(settings, stolen.request_id)
        ),
        until=lambda r: len(r) == 2,
    )
    cached = {r["tenant_id"]: r["cached_tokens"] for r in rows}
    assert cached[A] > 0  # the cache works for its owner
    assert cached[B] == 0


async def test_a_restarted_job_still_knows_which_ids_ran(
    settings: Settings, listener: TokenbusClient, stack: Stack
) -> None:
    """The ledger is a changelog-backed table: after a SIGKILL and a restart, a finished
    request produced again is answered ``duplicate_request``, and runs nothing."""
    value = body(listener.reply_topic, tenant_id=A)
    rid = value["request_id"]
    listener.watch(rid, A)
    await produce(settings, value, key=A, headers=bearer(bus_key(A)))
    chunks = await asyncio.wait_for(answer(listener, rid, A), 60)
    assert chunks[-1].error is None
    await eventually(lambda: billing_rows(settings, rid))

    await stack.restart("stream_job")  # SIGKILL, then started again
    await produce(settings, value, key=A, headers=bearer(bus_key(A)))
    deadline = time.monotonic() + 60
    while True:
        on_topic = await read_reply_topic(settings, listener.reply_topic, rid)
        if on_topic[-1].error is not None or time.monotonic() > deadline:
            break
    assert [c.seq for c in on_topic] == list(range(len(chunks) + 1))
    assert on_topic[-1].error is not None and on_topic[-1].error.code == "duplicate_request"
    await asyncio.sleep(2.0)  # the sink's batch interval: no second row
    rows = billing_rows(settings, rid)
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [("ok", 4)]
