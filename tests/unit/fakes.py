"""In-memory stand-ins for the dispatcher's I/O: a recording publisher, the reply log it
reads back, the request ledger, the quota windows, credentials the bus believes, and a
clock the test moves."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypedDict, cast

from schemas import TokenChunk, TokenChunkBatch, WorkItem, decode
from stream_jobs.dispatcher import Dispatcher
from stream_jobs.ledger import Entry, State
from stream_jobs.window import WindowState
from tokenbus.auth import Authenticator, mint_service_token, tenant_reply_prefix
from tokenbus.chunks import Chunk, from_model
from tokenbus.config import Settings
from tokenbus.span_buffer import SpanBuffer
from tokenbus.tenants import TenantDirectory
from tokenbus.topics import Topics

TOPICS = Topics()
SERVICE_SECRET = "unit-test-bus-service-secret-0123456789"


class SpanRow(TypedDict):
    """A span as ``SpanBuffer.record`` keeps it (``take()`` types it ``dict[str, object]``)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, object]


def taken_spans(buffer: SpanBuffer) -> dict[str, list[SpanRow]]:
    """``buffer.take()``, its rows typed field by field."""
    return cast(dict[str, list[SpanRow]], buffer.take())


class ManualClock:
    """A ``tokenbus.clock.Clock`` that moves only when told: both readings together."""

    def __init__(self, wall: float = 1_767_225_600.0, monotonic: float = 0.0) -> None:
        self.wall = wall
        self.mono = monotonic

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


class MemoryWindowStore:
    """The quota windows (``dispatcher.WindowStore``) in a dict."""

    def __init__(self) -> None:
        self._states: dict[str, WindowState] = {}

    def load(self, tenant_id: str) -> WindowState:
        return self._states.setdefault(tenant_id, WindowState())


class ChangelogTable(dict[bytes, bytes]):
    """What the job's ledger uses of a Faust table: the store (this dict), ``data`` (the
    store written without a record, as ``put_at`` does before it sends one itself) and
    ``send_changelog``. ``writes`` counts the changelog records (one per item set, one
    per record sent), ``sent`` holds those sent to explicit partitions, and ``reads``
    counts passes over the whole table."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.reads = 0
        self.sent: list[tuple[int, bytes, bytes]] = []

    @property
    def data(self) -> _TableStore:
        return _TableStore(self)

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.writes += 1
        super().__setitem__(key, value)

    def items(self) -> Any:
        self.reads += 1
        return super().items()

    def send_changelog(self, partition: int, key: bytes, value: bytes) -> None:
        self.writes += 1
        self.sent.append((partition, key, value))


class _TableStore:
    def __init__(self, table: ChangelogTable) -> None:
        self._table = table

    def __setitem__(self, key: bytes, value: bytes) -> None:
        dict.__setitem__(self._table, key, value)


@dataclass(frozen=True)
class Sent:
    """A broker's acknowledgement of one record: where it was written."""

    topic: str
    partition: int
    offset: int


class Recorder:
    """The publisher: every (topic, key, value) produced, in order. Each record is
    acknowledged at partition 0, its offset its place in that order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.headers: list[list[tuple[str, bytes]]] = []
        self._stalled: dict[str, asyncio.Event] = {}

    def stall(self, topic: str) -> asyncio.Event:
        """The next record to ``topic`` waits until the event returned is set, as a
        producer's first record to a topic waits for its metadata; records sent after
        it do not wait (the metadata is there by then)."""
        self._stalled[topic] = asyncio.Event()
        return self._stalled[topic]

    async def __call__(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> Sent:
        stalled = self._stalled.pop(topic, None)
        if stalled is not None:
            await stalled.wait()
        self.sent.append((topic, key, value))
        self.headers.append(list(headers or ()))
        return Sent(topic, 0, len(self.sent) - 1)

    def on(self, topic: str) -> list[bytes]:
        return [value for t, _, value in self.sent if t == topic]

    def chunks_on(self, topic: str) -> list[TokenChunk]:
        """Every chunk of every reply record on ``topic``, in order; keys are the tenant."""
        chunks: list[TokenChunk] = []
        for t, key, value in self.sent:
            if t == topic:
                batch = decode(TokenChunkBatch, value)
                assert key == batch.tenant_id.encode()
                chunks += batch.chunks
        return chunks


class Replies:
    """The reply topics, as the dispatcher reads them back on failover: what was recorded."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    async def read(
        self, *, reply_to: str, tenant_id: str, request_id: str, since: datetime
    ) -> list[Chunk]:
        return [
            from_model(c)
            for c in self._recorder.chunks_on(reply_to)
            if c.tenant_id == tenant_id and c.request_id == request_id
        ]


class Forwards:
    """The workers' topics, as a job adopting requests reads them back (``ForwardLog``):
    the recorded records, at the offsets ``Recorder`` acknowledged."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self.reads: list[list[tuple[str, int, int]]] = []

    async def read(self, places: list[tuple[str, int, int]]) -> dict[tuple[str, int, int], bytes]:
        self.reads.append(list(places))
        sent = self._recorder.sent
        return {
            (topic, partition, offset): sent[offset][2]
            for topic, partition, offset in places
            if partition == 0 and offset < len(sent) and sent[offset][0] == topic
        }


class MemoryLedger:
    """``stream_jobs.ledger.Ledger`` in a dict keyed (tenant, request_id)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], Entry] = {}
        self.num_durable = 0
        """Entries written with ``put_durably``."""

    def get(self, tenant_id: str, request_id: str) -> Entry | None:
        return self.entries.get((tenant_id, request_id))

    def put(self, tenant_id: str, request_id: str, entry: Entry) -> None:
        self.entries[(tenant_id, request_id)] = entry

    def put_at(self, home: int, tenant_id: str, request_id: str, entry: Entry) -> None:
        self.entries[(tenant_id, request_id)] = entry

    async def put_durably(
        self, home: int | None, tenant_id: str, request_id: str, entry: Entry
    ) -> None:
        self.entries[(tenant_id, request_id)] = entry
        self.num_durable += 1

    def drop(self, tenant_id: str, request_id: str) -> None:
        self.entries.pop((tenant_id, request_id), None)

    def forwarded(self, homes: set[int], now: float) -> list[tuple[str, str, Entry]]:
        return [
            (tenant, request_id, entry)
            for (tenant, request_id), entry in self.entries.items()
            if entry.state is State.FORWARDED
            and entry.forward is not None
            and entry.forward.home in homes
            and entry.expires_at > now
        ]

    def sweep(self, tenant_id: str, now: float) -> None:
        for key, entry in list(self.entries.items()):
            if key[0] == tenant_id and entry.expires_at <= now:
                del self.entries[key]


def reply_topic(tenant_id: str, client: str = "c1") -> str:
    """A reply topic every credential of ``tenant_id`` owns."""
    return TOPICS.replies(f"{tenant_id}.{client}")


def bus_authenticator(directory: TenantDirectory, *, allow_unlisted: bool = True) -> Authenticator:
    """The job's credential check: service tokens under ``SERVICE_SECRET``, API keys."""
    return Authenticator(
        directory,
        TOPICS,
        audience="tokenbus",
        service_secret=SERVICE_SECRET,
        allow_unlisted_tenants=allow_unlisted,
    )


def memory_dispatcher(
    settings: Settings,
    recorder: Recorder,
    *,
    ledger: MemoryLedger | None = None,
    allow_unlisted: bool = True,
    **options: Any,
) -> Dispatcher:
    """A dispatcher on memory stores that publishes into ``recorder`` and reads its
    replies back from it; ``options`` go to ``Dispatcher`` (clock, tracer, forwards)."""
    return Dispatcher(
        settings,
        recorder,
        MemoryWindowStore(),
        Replies(recorder),
        ledger if ledger is not None else MemoryLedger(),
        authenticator=bus_authenticator(settings.tenant_directory(), allow_unlisted=allow_unlisted),
        **options,
    )


def service_headers(tenant_id: str, **claims: object) -> list[tuple[str, bytes]]:
    """The ``authorization`` header a tokenbus service puts on ``tenant_id``'s request."""
    token = mint_service_token(
        SERVICE_SECRET,
        tenant_id,
        reply_prefix=tenant_reply_prefix(TOPICS, tenant_id),
        claims=dict(claims),
    )
    return [("authorization", f"Bearer {token}".encode())]


def bearer(credential: str) -> list[tuple[str, bytes]]:
    return [("authorization", f"Bearer {credential}".encode())]


async def cancel(dispatcher: Any, tenant_id: str, request_id: str, **fields: Any) -> None:
    """A producer's cancel, with the tenant's service token, as the cancel agent hands it."""
    from schemas import CancelRequest, encode
    from stream_jobs.dispatcher import Record

    message = CancelRequest(request_id=request_id, tenant_id=tenant_id, **fields)
    await dispatcher.handle_cancel(
        Record(
            TOPICS.cancels, 0, 0, tenant_id.encode(), encode(message), service_headers(tenant_id)
        )
    )


def work_item(**update: object) -> WorkItem:
    """A work item the job forwarded to ``w1``, with ``update`` applied."""
    base = WorkItem(
        request_id="r1",
        session_id="s1",
        tenant_id="t1",
        model="m",
        prompt="hello",
        reply_to="replies.t1",
        created_at=datetime(2024, 1, 1, tzinfo=UTC),
        admitted_at=datetime(2024, 1, 1, 0, 0, 1, tzinfo=UTC),
        cache_salt="t1",
        worker_id="w1",
        worker_incarnation="inc-1",
        dispatched_at=datetime(2024, 1, 1, tzinfo=UTC),
        flags=["max_tokens_capped"],
    )
    return base.model_copy(update=update)
