"""The Faust app: topics and agents wired to the Dispatcher.

# requests.p0/p1/p2 --> admit agents --> Dispatcher --> worker topics / reply topics
# usage --> settle agent --> Dispatcher.observe_usage (quota and budgets settle) --> alerts
# budgets (compacted) --> budgets task (every instance, from the start) --> BudgetBook
# cancels --> cancel agent --> Dispatcher.handle_cancel (drops waiting requests)
# heartbeats --> registry task (every instance reads every heartbeat)
# every load_report_interval_s --> Dispatcher.load_reports --> load (keyed by model)

Commits: Faust commits, every ``faust_commit_interval_s``, the offsets below the first
event not acked yet. The admit agents ack by hand (``noack``): each takes a batch of
what its stream holds ready and judges it in one loop turn (``Dispatcher.admit``, a task
per event that runs under that event, so its table writes land on its tenant's changelog
partition), and an event is acked only once its request has had its answer: a refused,
dead-lettered or duplicate request's once its answer is sent (a refusal only once the
broker holds its ledger entry: one redelivered after a crash is then a duplicate, not a
run beside the client's retry), an admitted one's after ``Dispatcher.finish``, once the
broker acknowledged its forward (or it was answered) and the ledger says so. So no
offset is committed before its request was forwarded or answered: a crash (a SIGKILL
mid-batch included) redelivers every request of the batch, and those after it, that were
not, and the ledger and the window's reservations keep a redelivered request from
running or being charged twice. A request whose handling fails is logged and its event
acked, as the per-event agent's loop acked the event it raised on: no taken event is
left unacked, for Faust waits for every one (``Consumer.wait_empty``) on shutdown and
rebalance. An agent stopped with requests not yet forwarded leaves their events unacked
(redelivered). Faust's commit flushes its producer first: ``track_producer_topics``
keeps that flush from waiting on a changelog record aiokafka lost the partition leader
of.

Budgets: spend lives in changelog-backed tables keyed by tenant first, written from the
agent of the tenant's partition (requests and usage are co-partitioned), so one
instance owns each tenant's budgets, and two instances are exact for tenant, key and
tenant x model budgets. A model budget spanning tenants sums what this instance holds:
exact with one instance. The settle agent publishes a threshold's alert after marking
it fired, before its event is acked: a crash in between loses that alert only if the
mark reached the changelog and the alert did not reach the topic.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, cast

import faust
import orjson
from aiokafka import TopicPartition
from faust.sensors import Sensor
from faust.streams import _current_event, current_event
from faust.types import EventT, StreamT, TableT
from prometheus_client import generate_latest

from schemas import encode
from stream_jobs import faust_drain, faust_pauses, faust_recovery
from stream_jobs.budgets import Reservation
from stream_jobs.changelog import DirectChangelog, direct_table
from stream_jobs.dispatcher import Admitted, Dispatcher, Record
from stream_jobs.intake_watch import IntakeWatch, PartitionIntake
from stream_jobs.ledger import Entry, State
from stream_jobs.metrics import faust_offsets, faust_partitions, job_registry
from stream_jobs.scaling import create_scaling_policy
from stream_jobs.window import Reservations, WindowState
from tokenbus import tansu
from tokenbus.clock import SYSTEM_CLOCK, Clock, OffsetClock
from tokenbus.config import Settings
from tokenbus.forwards import KafkaForwardLog
from tokenbus.heap import freeze_startup_heap
from tokenbus.kafka import key_partition, make_consumer, track_reply_topics
from tokenbus.metadata import ExistingTopics
from tokenbus.replies import KafkaReplyLog
from tokenbus.topics import Topics
from tokenbus.tracing import Tracing

log = logging.getLogger(__name__)
ADOPT_POLL_S = 0.5
"""How often the adoption of requests in flight looks whether the tables are recovered."""
ADOPT_AFTER_S = 5.0
"""How long after the tables are recovered the requests in flight are adopted."""


def _acks(value: int | str) -> int:
    return -1 if value == "all" else int(value)


class TableWindowStore:
    """Quota windows kept in the request ledger (``TableLedger``), whose entries carry
    their requests' reservations (``ledger.Reserved``), so a restarted job recovers them
    with the ledger before it consumes again. A window's reservations are written only
    with its requests' ledger entries, and its bucket sums are derived from them on load
    (``WindowState.of``): a request writes no record of its own for its quota.

    Decoded states are kept between requests. They are dropped whenever partitions
    move, because the table then changes under them."""

    def __init__(self, ledger: TableLedger) -> None:
        self._ledger = ledger
        self._states: dict[str, WindowState] = {}

    def load(self, tenant_id: str) -> WindowState:
        state = self._states.get(tenant_id)
        if state is None:
            state = WindowState.of(Reservations(dict(self._ledger.reservations_of(tenant_id))))
            self._states[tenant_id] = state
        return state

    def forget(self) -> None:
        self._states.clear()


class TableLedger:
    """The ledger of request ids (``stream_jobs.ledger``) in a Faust table keyed
    ``tenant/request_id``, backed by its changelog, so a restarted job still knows what
    ran. Expired entries are deleted as their tenant's requests come in, from an index
    made in one pass over the table after each start or rebalance; the same pass gathers
    the quota reservations the entries carry, for ``TableWindowStore``."""

    def __init__(self, table: TableT[bytes, bytes]) -> None:
        self._table = table
        self._index: dict[str, dict[str, float]] | None = None
        self._reserved: dict[str, list[tuple[str, list[int]]]] = {}

    def get(self, tenant_id: str, request_id: str) -> Entry | None:
        raw = self._table.get(f"{tenant_id}/{request_id}".encode())
        return Entry.from_json(orjson.loads(raw)) if raw else None

    def put(self, tenant_id: str, request_id: str, entry: Entry) -> None:
        self._table[f"{tenant_id}/{request_id}".encode()] = orjson.dumps(entry.to_json())
        self._note_expiry(tenant_id, request_id, entry)

    def _note_expiry(self, tenant_id: str, request_id: str, entry: Entry) -> None:
        expiries = self._indexed().setdefault(tenant_id, {})
        expiries.pop(request_id, None)  # to the end: the index stays in expiry order
        expiries[request_id] = entry.expires_at

    def put_at(self, home: int, tenant_id: str, request_id: str, entry: Entry) -> None:
        self._write(home, tenant_id, request_id, entry)

    async def put_durably(
        self, home: int | None, tenant_id: str, request_id: str, entry: Entry
    ) -> None:
        # As put (on the partition of the event being handled) or put_at, awaiting the
        # changelog record's future: Faust resolves it once the broker acknowledged it.
        if home is None:
            event = current_event()
            if event is None:
                raise RuntimeError("a ledger entry without a partition, outside an event")
            home = event.message.partition
        await self._write(home, tenant_id, request_id, entry)

    def _write(self, home: int, tenant_id: str, request_id: str, entry: Entry) -> Any:
        # Table.__setitem__ without its event: into the store, and to the changelog
        # partition of the tenant's requests, as a write under their event would go.
        # Returns the changelog record's future.
        key, value = f"{tenant_id}/{request_id}".encode(), orjson.dumps(entry.to_json())
        self._table.data[key] = value
        sent = self._table.send_changelog(home, key, value)
        self._note_expiry(tenant_id, request_id, entry)
        return sent

    def drop(self, tenant_id: str, request_id: str) -> None:
        self._table.pop(f"{tenant_id}/{request_id}".encode(), None)
        self._indexed().get(tenant_id, {}).pop(request_id, None)

    def forwarded(self, homes: set[int], now: float) -> list[tuple[str, str, Entry]]:
        found: list[tuple[str, str, Entry]] = []
        for key, value in list(self._table.items()):
            entry = Entry.from_json(orjson.loads(value))
            forward = entry.forward
            if (
                entry.state is State.FORWARDED
                and forward is not None
                and forward.home in homes
                and entry.expires_at > now
            ):
                tenant, _, request_id = key.decode().partition("/")
                found.append((tenant, request_id, entry))
        return found

    def sweep(self, tenant_id: str, now: float) -> None:
        expiries = self._indexed().get(tenant_id)
        if not expiries:
            return
        for request_id in _expired(expiries, now):
            self.drop(tenant_id, request_id)

    def reservations_of(self, window: str) -> list[tuple[str, list[int]]]:
        """(request_id, reservation) of each entry with a reservation in ``window``
        (``window.window_key``), in bucket order, as the table held them when it was last
        read whole (after a start or rebalance): for a window store's first load of the
        window, which is before any entry of it is written."""
        self._indexed()
        return self._reserved.pop(window, [])

    def forget(self) -> None:
        self._index = None
        self._reserved = {}

    def _indexed(self) -> dict[str, dict[str, float]]:
        if self._index is None:
            found: dict[str, list[tuple[float, str]]] = defaultdict(list)
            reserved: dict[str, list[tuple[str, list[int]]]] = defaultdict(list)
            for key, value in self._table.items():
                tenant, _, request_id = key.decode().partition("/")
                entry = Entry.from_json(orjson.loads(value))
                found[tenant].append((entry.expires_at, request_id))
                if entry.reserved is not None:
                    reservation = entry.reserved.reservation
                    reserved[entry.reserved.window].append((request_id, reservation))
            self._index = defaultdict(dict)
            for tenant, entries in found.items():
                self._index[tenant] = {rid: at for at, rid in sorted(entries)}
            self._reserved = {
                window: sorted(entries, key=lambda e: e[1][0])
                for window, entries in reserved.items()
            }
        return self._index


def _expired(expiries: dict[str, float], now: float, limit: int = 64) -> list[str]:
    """The first expired ids of an index kept in expiry order (each write moves its id to
    the end; the job's clock only moves on): a bounded share of work per request, and no
    pass over the entries still live. Expiry itself is judged on each entry; this only
    forgets them."""
    expired: list[str] = []
    for request_id, expires_at in expiries.items():
        if expires_at > now or len(expired) == limit:
            break
        expired.append(request_id)
    return expired


_SEP = "\t"
"""Separates the parts of a budget table's key: budget ids hold ``|``, ``:`` and ``/``."""


class TableSpendStore:
    """``stream_jobs.budgets.SpendStore`` in three changelog-backed tables, each keyed
    tenant first: spend ``tenant, budget, bucket`` -> [held, settled]; reservations
    ``tenant, request`` -> ``Reservation``; fired thresholds ``tenant, budget, bucket``
    -> [percent, ...]. Totals across tenants (a model's budget) and the expiry index of
    settled reservations are rebuilt in one pass after each start or rebalance."""

    def __init__(
        self,
        spend: TableT[bytes, bytes],
        reservations: TableT[bytes, bytes],
        fired: TableT[bytes, bytes],
    ) -> None:
        self._spend = spend
        self._reservations = reservations
        self._fired = fired
        self._totals: dict[tuple[str, str], tuple[int, int]] | None = None
        self._fired_totals: dict[tuple[str, str], set[int]] | None = None
        self._expiries: dict[str, dict[str, float]] | None = None

    @staticmethod
    def _key(*parts: str) -> bytes:
        return _SEP.join(parts).encode()

    def spent(self, budget_id: str, bucket: str) -> tuple[int, int]:
        return self._totals_now().get((budget_id, bucket), (0, 0))

    def add(self, tenant_id: str, budget_id: str, bucket: str, held: int, settled: int) -> None:
        key = self._key(tenant_id, budget_id, bucket)
        raw = self._spend.get(key)
        old_held, old_settled = orjson.loads(raw) if raw else (0, 0)
        self._spend[key] = orjson.dumps([old_held + held, old_settled + settled])
        totals = self._totals_now()
        total_held, total_settled = totals.get((budget_id, bucket), (0, 0))
        totals[(budget_id, bucket)] = (total_held + held, total_settled + settled)

    def reservation(self, tenant_id: str, request_id: str) -> Reservation | None:
        raw = self._reservations.get(self._key(tenant_id, request_id))
        return Reservation.from_json(orjson.loads(raw)) if raw else None

    def put_reservation(
        self, tenant_id: str, request_id: str, reservation: Reservation | None
    ) -> None:
        key = self._key(tenant_id, request_id)
        expiries = self._expiries_now().setdefault(tenant_id, {})
        if reservation is None:
            self._reservations.pop(key, None)
            expiries.pop(request_id, None)
            return
        self._reservations[key] = orjson.dumps(reservation.to_json())
        expiries.pop(request_id, None)  # to the end: the index stays in expiry order
        if reservation.settled:
            expiries[request_id] = reservation.expires_at

    def sweep(self, tenant_id: str, now: float) -> None:
        """Forgets settled reservations past their expiry, a bounded share per request."""
        expiries = self._expiries_now().get(tenant_id)
        if not expiries:
            return
        for request_id in _expired(expiries, now):
            self.put_reservation(tenant_id, request_id, None)

    def fired(self, budget_id: str, bucket: str) -> frozenset[int]:
        return frozenset(self._fired_now().get((budget_id, bucket), ()))

    def fire(self, tenant_id: str, budget_id: str, bucket: str, threshold: int) -> None:
        key = self._key(tenant_id, budget_id, bucket)
        raw = self._fired.get(key)
        marks = set(orjson.loads(raw)) if raw else set()
        self._fired[key] = orjson.dumps(sorted(marks | {threshold}))
        self._fired_now().setdefault((budget_id, bucket), set()).add(threshold)

    def buckets(self) -> list[tuple[str, str, int, int]]:
        return [(b, k, h, s) for (b, k), (h, s) in sorted(self._totals_now().items())]

    def forget(self) -> None:
        self._totals = self._fired_totals = self._expiries = None

    def _totals_now(self) -> dict[tuple[str, str], tuple[int, int]]:
        if self._totals is None:
            self._totals = {}
            for key, value in self._spend.items():
                _, budget_id, bucket = key.decode().split(_SEP)
                held, settled = orjson.loads(value)
                old = self._totals.get((budget_id, bucket), (0, 0))
                self._totals[(budget_id, bucket)] = (old[0] + held, old[1] + settled)
        return self._totals

    def _fired_now(self) -> dict[tuple[str, str], set[int]]:
        if self._fired_totals is None:
            self._fired_totals = defaultdict(set)
            for key, value in self._fired.items():
                _, budget_id, bucket = key.decode().split(_SEP)
                self._fired_totals[(budget_id, bucket)] |= set(orjson.loads(value))
        return self._fired_totals

    def _expiries_now(self) -> dict[str, dict[str, float]]:
        if self._expiries is None:
            found: dict[str, list[tuple[float, str]]] = defaultdict(list)
            for key, value in self._reservations.items():
                tenant_id, request_id = key.decode().split(_SEP)
                reservation = Reservation.from_json(orjson.loads(value))
                if reservation.settled:
                    found[tenant_id].append((reservation.expires_at, request_id))
            self._expiries = defaultdict(dict)
            for tenant_id, entries in found.items():
                self._expiries[tenant_id] = {rid: at for at, rid in sorted(entries)}
        return self._expiries


def job_clock(settings: Settings) -> Clock:
    """The job's clock: the system's, its wall reading moved by ``clock_offset_file`` in
    tests."""
    path = settings.clock_offset_file
    if path is None:
        return SYSTEM_CLOCK

    def offset() -> float:
        try:
            return float(path.read_text() or 0)
        except (OSError, ValueError):
            return 0.0

    return OffsetClock(offset)


def track_producer_topics(app: faust.App, settings: Settings) -> None:
    """Faust's producer (aiokafka's) tracks each topic it sends to from the first send
    (``tokenbus.metadata``): else a changelog record queued as a new topic is first sent
    to finds no leader for 30 s, and Faust's commit, which flushes the producer first,
    waits that long (so did a SIGTERM, in ``wait_empty``). It lets go of a reply topic
    it no longer answers on, so a deleted one is not made again."""
    producer = cast(Any, app.producer)
    new_producer = producer._new_producer

    def new_producer_tracking_topics(*args: Any, **kwargs: Any) -> Any:
        made = new_producer(*args, **kwargs)
        track_reply_topics(settings, made)
        return made

    producer._new_producer = new_producer_tracking_topics


def drop_faust_monitor(app: faust.App) -> None:
    """Faust's Monitor sensor is fed on every message in, every stream event in and out,
    every table read and write and every send (counters, timestamps, deques): a share
    of each request's CPU that only Faust's own stats pages read. tokenbus exports its
    own metrics (``stream_jobs.metrics``), so the job starts without it; ``app.monitor``
    still exists (Faust's consumer writes offsets to it directly). A sensor that does
    nothing takes its place: Faust warns at every rebalance when no sensor keeps state."""
    init_dependencies = app.on_init_dependencies

    def without_monitor() -> Any:
        dependencies = init_dependencies()  # adds the monitor to the sensors
        app.sensors.remove(app.monitor)
        app.sensors.add(Sensor())
        return dependencies

    app.on_init_dependencies = without_monitor  # type: ignore[method-assign]


def faust_app(settings: Settings) -> faust.App:
    """The job's Faust app as configured, with no agent yet: the broker, serializers,
    timeouts and producer settings every instance of the job shares."""
    tansu.install_for_faust(settings)  # the bundled broker's workarounds; none on Kafka
    faust_recovery.install()  # Faust loses fetched records otherwise, on any broker
    faust_pauses.install()  # a recovered table's changelog is not fetched, on any broker
    faust_drain.install()  # a record reaches its agent without four tasks, on any broker
    brokers = ";".join(f"kafka://{host}" for host in settings.bootstrap.split(","))
    app = faust.App(
        settings.faust_app_id,
        broker=brokers,
        key_serializer="raw",
        value_serializer="raw",
        web_enabled=settings.faust_web_port is not None,
        web_port=settings.faust_web_port or 6066,
        web_bind=settings.faust_web_host,
        datadir=str(settings.faust_dir),
        topic_partitions=settings.num_partitions,
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=True,
        broker_session_timeout=settings.faust_session_timeout_s,
        broker_rebalance_timeout=settings.faust_rebalance_timeout_s,
        broker_heartbeat_interval=settings.faust_heartbeat_interval_s,
        broker_commit_interval=settings.faust_commit_interval_s,
        producer_acks=_acks(settings.kafka_acks),
        producer_linger_ms=settings.linger_ms,
        producer_max_batch_size=settings.producer_batch_bytes,
        consumer_auto_offset_reset="earliest",
    )
    track_producer_topics(app, settings)
    drop_faust_monitor(app)
    return app


def create_app(settings: Settings) -> faust.App:
    app = faust_app(settings)
    topics = Topics(settings.topic_prefix)

    changelog = DirectChangelog(app)

    def table(name: str) -> Any:
        """A changelog-backed table of bytes, keyed tenant first, one partition per
        request partition (so each instance holds the tenants it reads); its changelog
        records go straight to aiokafka (``stream_jobs.changelog``)."""
        return direct_table(app, changelog, name, settings.num_partitions)

    # Keyed by tenant, like every stream that writes it: requests and usage are
    # co-partitioned, so one instance owns each tenant's window.
    # One entry per request id per tenant: what ran, so a repeat does not run again.
    ledger = TableLedger(table("request-ledger"))
    store = TableWindowStore(ledger)

    # Spend budgets: keyed tenant first, written from the tenant's partition.
    spend = TableSpendStore(
        *(table(name) for name in ("budget-spend", "budget-reservations", "budget-fired"))
    )
    assigned: list[bool] = []
    to_adopt = asyncio.Event()

    def on_partitions_moved(sender: Any, *args: Any, signal: Any, **kwargs: Any) -> None:
        store.forget()
        ledger.forget()
        spend.forget()

    def on_partitions_assigned(sender: Any, *args: Any, signal: Any, **kwargs: Any) -> None:
        on_partitions_moved(sender, *args, signal=signal, **kwargs)
        assigned[:] = [True]
        to_adopt.set()

    # mode's handler type (mypy_extensions' NamedArg) matches no plain def.
    app.on_partitions_revoked.connect(on_partitions_moved)  # type: ignore[arg-type]
    app.on_partitions_assigned.connect(on_partitions_assigned)  # type: ignore[arg-type]

    state: dict[str, Dispatcher] = {}
    clock = job_clock(settings)

    async def publish(
        topic: str, key: bytes, value: bytes, headers: Sequence[tuple[str, bytes]] | None = None
    ) -> Any:
        return await app.producer.send_and_wait(
            topic,
            key,
            value,
            partition=None,
            timestamp=None,
            headers=list(headers) if headers else None,
        )

    knows_topic = ExistingTopics(lambda: cast(Any, app.producer)._ensure_producer().client)

    tracing = Tracing(settings, "job")

    def dispatcher() -> Dispatcher:
        if "dispatcher" not in state:
            state["dispatcher"] = Dispatcher(
                settings,
                publish,
                store,
                KafkaReplyLog(settings),
                ledger,
                clock=clock,
                spend=spend,
                tracer=tracing.tracer,
                forwards=KafkaForwardLog(settings),
                home_of=functools.partial(key_partition, num_partitions=settings.num_partitions),
                knows_topic=knows_topic,
            )
        return state["dispatcher"]

    @app.timer(interval=settings.trace_flush_interval_s)
    async def send_spans() -> None:
        # Best effort: a refused batch is logged and dropped (tokenbus.tracing).
        await tracing.flush(publish)

    def admit_agent(priority: int) -> None:
        topic = app.topic(topics.requests(priority), key_type=bytes, value_type=bytes)
        lag = f"requests_p{priority}"

        async def more_coming(ready: Any) -> bool:
            # Faust's fetcher hands a fetch's records to the stream one at a time, a
            # loop turn or two apart: a few turns tell a burst from a lone request.
            if ready is None:
                return False
            for _ in range(settings.admit_batch_turns):
                if not ready.empty():
                    return True
                await asyncio.sleep(0)
            return not ready.empty()

        async def admit(stream: StreamT[bytes]) -> None:
            # A batch is what the stream holds ready. Each request is judged in a task of
            # its own, under its event (so its table writes land on its tenant's
            # partition): all of a batch's tasks judge in one loop turn, in order (the
            # admitted path does not await before its request is queued), and none waits
            # for another's refusal to reach the broker. Each event is acked once its
            # request has had its answer (forwarded, refused, dead-lettered), in any order.
            source = cast("faust.Stream[bytes]", stream).noack()
            ready = getattr(source.channel, "queue", None)
            handling: set[asyncio.Task[None]] = set()
            room = asyncio.Event()  # set by a task's end while fewer than the most are held
            batch: list[EventT[bytes]] = []

            async def handle(event: EventT[bytes]) -> None:
                # A task runs in a copy of its creator's context: this event is current
                # for this task only, as Faust's stream makes each event current.
                _current_event.set(weakref.ref(event))
                message = event.message
                try:
                    dispatcher().note_lag(lag, message.timestamp)
                    spend.sweep((message.key or b"").decode("utf-8", "replace"), clock.time())
                    result = await dispatcher().admit(_record(message))
                    if isinstance(result, Admitted):
                        await dispatcher().finish(result)
                except Exception:
                    # As the per-event agent did (its loop acked the event it raised on):
                    # logged and acked, so this one request is not retried for good and
                    # Faust's wait for unacked events (rebalance, shutdown) can end.
                    log.exception(
                        "admitting %s[%d]@%d failed",
                        message.topic,
                        message.partition,
                        message.offset,
                    )
                # Not on cancellation (the agent stops): left unacked, it is redelivered.
                await source.ack(event)

            def handled(task: asyncio.Task[None]) -> None:
                handling.discard(task)
                if len(handling) < settings.admit_concurrency:
                    room.set()

            try:
                async for event in source.events():
                    batch.append(event)
                    if len(batch) < settings.admit_batch_max and await more_coming(ready):
                        continue  # they join this batch
                    await budgets_read.wait()  # runtime budgets bind from the first request
                    for event in batch:
                        task = asyncio.create_task(handle(event))
                        handling.add(task)
                        task.add_done_callback(handled)
                    batch.clear()
                    # Not asyncio.wait(handling): it hooks and unhooks every task held
                    # (256 by default) each time one ends, about 5% of the job's CPU
                    # in an admission burst (BENCHMARKS.md).
                    while len(handling) >= settings.admit_concurrency:
                        room.clear()
                        await room.wait()
            finally:
                # Stopped: Faust has waited for every taken event to be acked (its
                # ``wait_empty`` on shutdown and rebalance) before it stops an agent, so
                # what is left here was not forwarded; unacked, it is redelivered.
                for task in handling:
                    task.cancel()

        app.agent(topic, name=f"admit_p{priority}")(admit)

    for priority in (0, 1, 2):
        admit_agent(priority)

    usage_topic = app.topic(topics.usage, key_type=bytes, value_type=bytes)

    @app.agent(usage_topic, name="settle_usage")
    async def settle_usage(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            dispatcher().note_lag("usage", event.message.timestamp)
            dispatcher().observe_usage(event.message.value)
            await dispatcher().publish_raised()

    cancels_topic = app.topic(topics.cancels, key_type=bytes, value_type=bytes)

    @app.agent(cancels_topic, name="cancel_waiting")
    async def cancel_waiting(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            message = event.message
            try:
                await dispatcher().handle_cancel(_record(message))
            except Exception:
                # Logged and passed, as a request's failure is: one cancel must not end
                # the agent, and with it every cancel after it.
                log.exception(
                    "cancel %s[%d]@%d failed", message.topic, message.partition, message.offset
                )

    @app.task
    async def dispatch_loop() -> None:
        await dispatcher().run()

    def recovered() -> bool:
        return (
            not app.rebalancing
            and not app.in_recovery
            and getattr(app.tables, "recovery").completed.is_set()  # noqa: B009 (untyped)
        )

    @app.task
    async def adopt_in_flight() -> None:
        # After each assignment, once its tables are recovered: the requests forwarded
        # for these partitions (by an earlier run, or the instance that held them) are
        # this instance's to watch (``Dispatcher.take_partitions``). A failed try is
        # logged and made again.
        requests = set(topics.all_requests)
        while True:
            await to_adopt.wait()
            if not recovered():
                await asyncio.sleep(ADOPT_POLL_S)
                continue
            to_adopt.clear()
            # Not at once: adopting as the streams resumed (a consumer of its own made and
            # read right then) was followed, in 3 runs of 3, by the restarted job never
            # taking the requests waiting for it, before Faust's fetch was given a fixed
            # set of partitions (stream_jobs.faust_recovery), whose race the adoption's
            # work likely widened. ADOPT_AFTER_S later costs only the adoption's delay.
            await asyncio.sleep(ADOPT_AFTER_S)
            homes = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic in requests}
            try:
                await dispatcher().take_partitions(homes)
            except Exception:
                log.exception("could not adopt the requests in flight; trying again")
                await asyncio.sleep(ADOPT_POLL_S)
                to_adopt.set()

    @app.task
    async def freeze_heap() -> None:
        # Once, when the first recovery is over: start-up's objects (Faust's, the tables'
        # as recovered) out of the cycle collector's walks (tokenbus.heap).
        recovery = getattr(app.tables, "recovery")  # noqa: B009 (untyped)
        await recovery.completed.wait()
        freeze_startup_heap("job", settings.gc_gen0_threshold)

    @app.task
    async def publish_load() -> None:
        # Every instance reports what it holds, keyed by model; a lost report is
        # replaced by the next one, so nothing here waits or retries.
        instance = f"{socket.gethostname()}-{os.getpid()}"
        while True:
            await asyncio.sleep(settings.load_report_interval_s)
            try:
                for report in dispatcher().load_reports(instance):
                    await publish(topics.load, report.model.encode(), encode(report))
            except Exception:
                log.exception("could not publish the load reports")

    @app.task
    async def follow_heartbeats() -> None:
        # No consumer group: every instance of the job must see every worker.
        consumer = make_consumer(
            settings, group_id=None, auto_offset_reset="latest", background=True
        )
        await consumer.start()
        try:
            await consumer.topics()  # loads metadata, so the partitions below are known
            partitions = consumer.partitions_for_topic(topics.heartbeats) or {0}
            consumer.assign([TopicPartition(topics.heartbeats, p) for p in partitions])
            async for record in consumer:
                dispatcher().observe_heartbeat(record.value)
        finally:
            await consumer.stop()

    budgets_read = asyncio.Event()

    @app.task
    async def follow_budgets() -> None:
        # No consumer group: every instance applies every budget change, from the start
        # of the compacted topic; admission waits until it has read up to the end.
        consumer = make_consumer(
            settings, group_id=None, auto_offset_reset="earliest", background=True
        )
        await consumer.start()
        try:
            await consumer.topics()
            partitions = [
                TopicPartition(topics.budgets, p)
                for p in consumer.partitions_for_topic(topics.budgets) or {0}
            ]
            consumer.assign(partitions)
            await consumer.seek_to_beginning(*partitions)
            ends = await consumer.end_offsets(partitions)
            started, num_records = time.monotonic(), 0
            while not budgets_read.is_set():
                positions = [await consumer.position(tp) for tp in partitions]
                if all(at >= ends[tp] for at, tp in zip(positions, partitions, strict=True)):
                    elapsed = time.monotonic() - started
                    log.info("budgets read: %d records in %.1f s", num_records, elapsed)
                    budgets_read.set()
                    break
                if time.monotonic() - started > settings.budgets_read_timeout_s:
                    # Admission must not wait for good on a topic that will not reach its
                    # end offset: it goes on with what was read, the rest binds as read.
                    log.warning(
                        "budgets not read to the end in %.0f s (at %s of %s): admitting",
                        settings.budgets_read_timeout_s,
                        positions,
                        [ends[tp] for tp in partitions],
                    )
                    budgets_read.set()
                    break
                batch = await consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    num_records += len(records)
                    for record in records:
                        dispatcher().observe_budget(record.key, record.value)
            async for record in consumer:
                dispatcher().observe_budget(record.key, record.value)
        finally:
            budgets_read.set()  # a broken budgets topic must not stop admission for good
            await consumer.stop()

    if settings.job_intake_stall_s > 0:
        watch = IntakeWatch(settings.job_intake_stall_s)
        request_topics = set(topics.all_requests)

        @app.timer(interval=min(5.0, settings.job_intake_stall_s / 3))
        async def watch_intake() -> None:
            # Logging only: what no other warning covers (stream_jobs.intake_watch).
            for intake in watch.observe(request_intakes(app, request_topics)):
                log.warning(
                    "the job has taken nothing of %s for %.0f s while behind it (flow %s)",
                    intake.describe(),
                    settings.job_intake_stall_s,
                    "on" if getattr(app.consumer, "flow_active", None) else "off",
                )

    @app.page("/healthz")
    async def healthz(web: Any, request: Any) -> Any:
        """200 once this instance holds its share of the group's partitions and has
        recovered its tables; 503 while it joins, rebalances or recovers."""
        ready = bool(assigned) and recovered()
        return web.json({"ready": ready}, status=200 if ready else 503)

    registry = job_registry(
        lambda: dispatcher().metrics,
        lambda: dispatcher().budget_rows(),
        waiting=lambda: dispatcher().waiting_counts(),
        lag=faust_offsets(app, [topics.requests(p) for p in (0, 1, 2)]),
        partitions=faust_partitions(app),
        changelog=lambda: (changelog.num_sent, changelog.num_failed),
        scaling=create_scaling_policy(
            settings.scaling_target_utilisation,
            settings.scaling_min_workers,
            settings.scaling_max_workers,
        ),
        default_max_num_seqs=settings.max_num_seqs,
    )

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        # aiohttp takes the charset apart from the type: Prometheus's text format 0.0.4.
        return web.bytes(generate_latest(registry), content_type="text/plain; version=0.0.4")

    @app.page("/budgets")
    async def budget_state(web: Any, request: Any) -> Any:
        return web.json(
            {"budgets": dispatcher().budget_rows(), "buckets": dispatcher().budget_buckets()}
        )

    return app


def request_intakes(app: faust.App, topics: set[str]) -> list[PartitionIntake]:
    """Where the Faust consumer stands on each partition of ``topics``: Faust's read
    offsets, and the position, high-water mark and held records of the aiokafka consumer
    under it. Looks only; that consumer runs in a thread of its own, so a look that
    races a change is dropped (the next one comes in seconds)."""
    try:
        consumer = cast(Any, app.consumer)
        inner = consumer._thread._consumer
        assignment = inner._subscription.subscription.assignment
        held = set(inner._fetcher._records)
        active = consumer._active_partitions
        paused = set(consumer._paused_partitions)
        read_offsets = consumer._read_offset
        intakes = []
        for tp in list(assignment.tps):
            if tp.topic not in topics:
                continue
            state = assignment.state_value(tp)
            intakes.append(
                PartitionIntake(
                    tp.topic,
                    tp.partition,
                    read_offsets.get(tp),
                    state.position if state.has_valid_position else None,
                    state.highwater,
                    held=tp in held,
                    paused=tp in paused or (active is not None and tp not in active),
                )
            )
        return intakes
    except Exception:  # not started, between assignments, or a racing change
        return []


def _record(message: Any) -> Record:
    """A Faust message as the dispatcher's handlers take it."""
    m = message
    return Record(m.topic, m.partition, m.offset, m.key, m.value, m.headers)
