"""The client's reply routing, with a consumer that yields prepared records."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from producers import TokenbusClient
from schemas import (
    DeadLetter,
    FinishReason,
    InferenceRequest,
    TokenChunk,
    TokenChunkBatch,
    decode,
    encode,
)
from tokenbus.chunks import Chunk, from_model
from tokenbus.config import Settings
from tokenbus.prompt_vouch import HEADER as VOUCH_HEADER
from tokenbus.prompt_vouch import vouched
from tokenbus.span_path import path_header
from tokenbus.topics import Topics, reply_batch_key


@dataclass
class Record:
    value: bytes
    key: bytes
    topic: str = "replies"
    partition: int = 0
    offset: int = 0
    headers: tuple[tuple[str, bytes], ...] = ()


class Consumer:
    def __init__(self, records: list[Record]) -> None:
        self._records = records

    async def getmany(self, timeout_ms: int = 0) -> dict[str, list[Record]]:
        records, self._records = self._records, []
        return {"replies": records}


class Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.records: list[tuple[str, bytes, bytes, object]] = []

    async def send_and_wait(
        self, topic: str, value: bytes, key: bytes, headers: object = None
    ) -> None:
        self.sent.append((topic, value))
        self.records.append((topic, value, key, headers))


def chunk(request_id: str, seq: int, finish: FinishReason | None = None) -> TokenChunk:
    return TokenChunk(
        request_id=request_id,
        tenant_id="t",
        seq=seq,
        text=f"{request_id}.{seq}",
        token_ids=[seq],
        num_tokens=1,
        finish_reason=finish,
    )


def batch(*chunks: TokenChunk) -> Record:
    return Record(encode(TokenChunkBatch(tenant_id="t", chunks=list(chunks))), reply_batch_key("t"))


def request(request_id: str) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id,
        session_id="s",
        tenant_id="t",
        model="m",
        prompt="hi",
        reply_to="replies",
    )


async def test_a_batch_is_fanned_out_to_its_requests_streams(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path, client_timeout_s=1))
    client._producer = Producer()
    client._consumer = Consumer(
        [
            batch(chunk("r1", 0), chunk("r2", 0), chunk("nobody", 0)),
            batch(chunk("r2", 1, finish=FinishReason.STOP), chunk("r1", 1)),
            batch(
                chunk("r1", 1), chunk("r1", 2, finish=FinishReason.LENGTH)
            ),  # seq 1 again: dropped
        ]
    )
    r1, r2 = request("r1"), request("r2")
    client.watch("r1", "t")
    client.watch("r2", "t")
    await client._route_replies()

    async def texts(req: InferenceRequest) -> list[str]:
        return [c.text async for c in client.stream(req)]

    assert await asyncio.wait_for(texts(r1), 1) == ["r1.0", "r1.1", "r1.2"]
    assert await asyncio.wait_for(texts(r2), 1) == ["r2.0", "r2.1"]


async def test_a_record_that_is_not_a_batch_is_dead_lettered(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path, client_timeout_s=1))
    producer = Producer()
    client._producer = producer
    bare = Record(encode(chunk("r1", 0)), b"t/r1", offset=4)  # a chunk outside a batch
    client._consumer = Consumer([bare, batch(chunk("r1", 0, finish=FinishReason.STOP))])
    client.watch("r1", "t")
    await client._route_replies()

    ((topic, value),) = producer.sent
    letter = decode(DeadLetter, value)
    assert topic == Topics().dead_letters and letter.offset == 4
    assert "invalid TokenChunkBatch" in letter.reason
    assert "unknown field `request_id`" in letter.reason
    assert orjson.loads(letter.payload)["request_id"] == "r1"
    assert [c.seq async for c in client.stream(request("r1"))] == [0]


async def test_a_chunk_reaches_a_stream_only_from_a_batch_of_its_tenant(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path, client_timeout_s=1))
    client._producer = Producer()
    other = TokenChunk(
        request_id="r1", tenant_id="u", seq=0, text="u.r1.0", finish_reason=FinishReason.STOP
    )
    spoofed = Record(encode(TokenChunkBatch(tenant_id="u", chunks=[other])), reply_batch_key("u"))
    client._consumer = Consumer(
        [spoofed, batch(chunk("r1", 0), chunk("r1", 1, finish=FinishReason.STOP))]
    )
    client.watch("r1", "t")
    await client._route_replies()
    assert [c.text async for c in client.stream(request("r1"))] == ["r1.0", "r1.1"]


async def test_submit_sends_the_credential_and_keys_by_tenant(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path), "c1", credential="sk-t", tenant_id="t")
    producer = Producer()
    client._producer = producer
    sent = await client.submit(prompt="hi")
    ((topic, value, key, headers),) = producer.records
    assert topic == Topics().requests(1) and key == b"t"
    assert headers == [("authorization", b"Bearer sk-t")]
    assert decode(InferenceRequest, value) == sent
    assert sent.reply_to == "tokenbus.replies.t.c1" and sent.tenant_id == "t"


async def test_a_record_keyed_for_another_tenant_is_dead_lettered(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path, client_timeout_s=1))
    producer = Producer()
    client._producer = producer
    good = batch(chunk("r1", 0, finish=FinishReason.STOP))
    client._consumer = Consumer([Record(good.value, reply_batch_key("u"), offset=9), good])
    client.watch("r1", "t")
    await client._route_replies()
    ((topic, value),) = producer.sent
    letter = decode(DeadLetter, value)
    assert topic == Topics().dead_letters and letter.offset == 9
    assert "record key b'u' is not the key of the batch's tenant 't'" in letter.reason
    assert [c.seq async for c in client.stream(request("r1"))] == [0]


class ReplyLog:
    """What the reply topic holds, as ``KafkaReplyLog.read`` returns it."""

    def __init__(self, chunks: list[TokenChunk]) -> None:
        self.chunks = [from_model(c) for c in chunks]
        self.reads = 0

    async def read(self, **_: object) -> list[Chunk]:
        self.reads += 1
        return self.chunks


async def test_a_gap_is_filled_from_the_reply_topic(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path, client_timeout_s=5))
    client._producer = Producer()
    log = ReplyLog([chunk("r1", 0), chunk("r1", 1)])
    client._reply_log = log  # type: ignore[assignment]
    client._consumer = Consumer([batch(chunk("r1", 1), chunk("r1", 2, finish=FinishReason.STOP))])
    client.watch("r1", "t")
    await client._route_replies()
    seqs = [c.seq async for c in client.stream(request("r1"))]
    assert seqs == [0, 1, 2] and log.reads == 1


async def test_a_quiet_stream_delivers_what_the_read_back_found_at_once(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path, client_timeout_s=30, client_quiet_s=0.05))
    client._producer = Producer()
    log = ReplyLog([chunk("r1", 0), chunk("r1", 1, finish=FinishReason.STOP)])
    client._reply_log = log  # type: ignore[assignment]
    client.watch("r1", "t")
    started = asyncio.get_running_loop().time()
    seqs = await asyncio.wait_for(
        asyncio.ensure_future(_seqs(client.stream(request("r1")))), timeout=5
    )
    assert seqs == [0, 1] and log.reads == 1
    assert asyncio.get_running_loop().time() - started < 1  # not after another quiet spell


async def _seqs(chunks: AsyncIterator[Chunk]) -> list[int]:
    return [c.seq async for c in chunks]


async def test_a_streams_first_reply_record_tells_where_its_path_stood(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path, client_timeout_s=1))
    client._producer = Producer()
    first, later = batch(chunk("r1", 0)), batch(chunk("r1", 1, finish=FinishReason.STOP))
    first.headers, later.headers = (path_header(111),), (path_header(222),)
    client._consumer = Consumer([first, later])
    r1 = request("r1")
    client.watch("r1", "t")
    assert client.reply_sent_ns(r1) is None  # nothing read yet
    await client._route_replies()
    # The first chunk's record's, not a later one's, and kept past the stream's end (a
    # short stream may be read to its end before its first chunk is looked at).
    assert [c.seq async for c in client.stream(r1)] == [0, 1]
    assert client.reply_sent_ns(r1) == 111
    assert client.reply_sent_ns(r1) is None  # taken


async def test_first_chunk_stamps_nobody_asks_for_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("producers.client.MAX_REPLY_STAMPS", 2)
    client = TokenbusClient(Settings(home=tmp_path, client_timeout_s=1))
    client._producer = Producer()
    records = []
    for n, request_id in enumerate(("r1", "r2", "r3")):
        record = batch(chunk(request_id, 0))
        record.headers = (path_header(100 + n),)
        records.append(record)
        client.watch(request_id, "t")
    client._consumer = Consumer(records)
    await client._route_replies()
    assert [client.reply_sent_ns(request(r)) for r in ("r1", "r2", "r3")] == [None, 101, 102]


@pytest.mark.parametrize(
    ("profile", "minted", "rolls"),
    [("tansu", True, True), ("tansu", False, False), ("kafka", True, False)],
    ids=["tansu-minted", "tansu-given-key", "kafka"],
)
def test_a_client_rolls_its_reply_topics_only_on_tansu_and_with_tokens_minted_for_it(
    profile: str, minted: bool, rolls: bool, tmp_path: Path
) -> None:
    """A key or token handed to the client may own one reply topic by its exact name (a
    JWT's ``reply_prefix``): such a client keeps that one topic."""
    settings = Settings.model_validate(
        {"home": tmp_path, "broker_profile": profile, "bus_service_secret": "s" * 32}
    )
    client = (
        TokenbusClient(settings, "c1")
        if minted
        else TokenbusClient(settings, "c1", credential="sk-acme", tenant_id="acme")
    )
    base = Topics(settings.topic_prefix).replies("c1" if minted else "acme.c1")
    if rolls:
        assert (client.reply_topic, client.reply_prefix) == (f"{base}.0", f"{base}.")
    else:
        assert client.reply_topic == client.reply_prefix == base


async def test_a_service_client_vouches_for_the_prompt_count_it_is_given(tmp_path: Path) -> None:
    secret = "unit-test-bus-service-secret-0123456789"
    client = TokenbusClient(Settings(home=tmp_path, bus_service_secret=secret), "bridge")
    producer = Producer()
    client._producer = producer
    await client.submit(tenant_id="t", prompt="hi", num_prompt_tokens=3)
    await client.submit(tenant_id="t", prompt="hi")
    (_, value, _, headers), (_, _, _, plain) = producer.records
    assert isinstance(headers, list) and isinstance(plain, list)
    assert vouched(secret, value, dict(headers)[VOUCH_HEADER]) == 3
    assert VOUCH_HEADER not in dict(plain)


async def test_a_program_s_client_cannot_vouch_for_a_prompt_count(tmp_path: Path) -> None:
    client = TokenbusClient(Settings(home=tmp_path), "c1", credential="sk-t", tenant_id="t")
    producer = Producer()
    client._producer = producer
    with pytest.raises(ValueError, match="only a tokenbus service's client"):
        await client.submit(prompt="hi", num_prompt_tokens=3, request_id="r1")
    assert producer.records == []
    assert client._streams == {}  # nothing is watched for a request never sent
