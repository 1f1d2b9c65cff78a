"""Admission and dispatch: the thin shell around the job's policies.

# record + authorization header --> InferenceRequest (public) --> Principal (tokenbus.auth)
# --> reply topic owned? tenant and key its own? --> WorkItem --> ledger (one id, one run)
# --> tenant rules --> overload tier --> spend budgets (max cost) --> TPM/RPM window
# admitted request --> FairQueue (class, then VTC share) --> routing.choose --> worker topic
# a worker run lost (registry.reap) --> its requests: usage written, or sent again resumed
# UsageEvent --> settle the window and the budgets (billed cost), free the slot, correct
#   the tenant's VTC counter; a budget threshold reached --> BudgetAlert (budget-alerts)
# budgets topic (runtime changes, every instance) --> the BudgetBook
# CancelRequest + credential --> drop the request if it is still waiting, else --> aborts

Delivery: ``handle_request`` returns only once its request has been forwarded to a
worker (acknowledged by the broker), answered with a chunk on its reply topic (a
TokenChunkBatch of one), or dead-lettered. The Faust agent acks the event after that,
and Faust commits only acked offsets, so a crash redelivers rather than loses. A
redelivered request is not charged twice: its reservation is already in the window.

Trust: nothing in a request record is believed that a producer could forge. The
credential in its ``authorization`` header names the tenant, its class ceiling, models,
balance and reply topics; the job derives every other field of the ``WorkItem`` it
hands a worker (attempt, cache salt, tier, times). A refusal goes back as an error chunk
only to a reply topic the producer owns; one whose producer is not known goes back only
if its request id is not one the job holds (so no one can end another's stream), and
is recorded as a rejected UsageEvent only then (so no one can shadow another's row).

Clock: one injected ``tokenbus.clock.Clock``, and no other reading of time. Its wall
reading (``time()``) stamps what the job hands on (admission, dispatch, alerts), keys the
windows, the ledger and the budget periods, and measures other processes' stamps (a
heartbeat's age, an input's lag, a span's start); its monotonic reading measures what
only this instance times (queue waits, worker liveness, the load reports' intervals,
the start-up grace), so a wall clock that steps (or a test that moves it) reaps no
worker by itself. Moved ahead, the wall reading makes heartbeats look that much older:
they are ignored until it is moved back, and a worker seen before stays live for
``worker_dead_after_s``. Waiting is the event loop's (the dispatch loop's periodic look,
``FORWARD_RETRY_S``): a test moves the clock, then lets the loop turn.

State: the windows live in a ``WindowStore``, changed only from the agent handling the
tenant's partition; each request's reservation is kept in its ledger entries
(``ledger.Reserved``, written with them by ``_entry`` and ``observe_usage``). The queue,
the in-flight set, session affinity and the tier are this instance's own, rebuilt from
redeliveries and heartbeats. (The in-flight set is what failover resends from: a job
restarted while a worker dies loses that worker's running requests; clients see a
timeout.)
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any, NamedTuple, Protocol

import orjson
from aiokafka.errors import MessageSizeTooLargeError
from opentelemetry.context import Context
from opentelemetry.trace import (
    NoOpTracer,
    Span,
    SpanKind,
    StatusCode,
    Tracer,
    set_span_in_context,
)

from schemas.budgets import BudgetAlert
from schemas.codec import SchemaError, decode, encode
from schemas.fleet import LoadReport, WorkerStatus
from schemas.messages import REASSIGNED, Adapter, CancelRequest, InferenceRequest, WorkItem
from schemas.replies import ErrorInfo, FinishReason, TokenChunk, TokenChunkBatch
from schemas.usage import UsageEvent, UsageStatus
from stream_jobs import budgets
from stream_jobs.adapter_routing import choose_for_adapter
from stream_jobs.affinity import SessionAffinity
from stream_jobs.answer_order import AnswerOrder, Turn
from stream_jobs.budgets import Budget, BudgetBook, MemorySpendStore, SpendStore, Subject
from stream_jobs.fair_queue import FairQueue
from stream_jobs.in_flight import Facets, InFlightTable
from stream_jobs.ledger import (
    MAX_COPIES,
    Entry,
    Forward,
    Ledger,
    Reserved,
    State,
    Verdict,
    carried,
    ended,
    judge,
)
from stream_jobs.load import LoadTracker, load_report
from stream_jobs.prompt_tokens import PromptCounter
from stream_jobs.recovery import Delivered, delivered, resume
from stream_jobs.registry import WorkerRegistry
from stream_jobs.routing import RoutingWeights
from stream_jobs.seats import BATCH_CLASS, has_room
from stream_jobs.tiers import Tier, TierPolicy, apply_tier, demand_ratio
from stream_jobs.window import Limits, WindowState, release, reserve, settle, window_key
from tokenbus.auth import TENANT_ID, Authenticator, AuthError, Principal
from tokenbus.batch_yield import create_batch_yield, num_yielding
from tokenbus.budget_config import BudgetConfig, parse_budget_id
from tokenbus.chunks import Chunk
from tokenbus.clock import SYSTEM_CLOCK, Clock
from tokenbus.config import Settings
from tokenbus.cost import PeakHours, cost_weight
from tokenbus.dlq import dead_letter_record
from tokenbus.kafka import Publish
from tokenbus.lean_span import start_span
from tokenbus.logs import bind_request
from tokenbus.price_file import load_price_book
from tokenbus.pricing import Pricer
from tokenbus.prompt_vouch import HEADER as VOUCH_HEADER
from tokenbus.prompt_vouch import vouched
from tokenbus.span_path import hop_span, path_ns
from tokenbus.tenants import TenantDirectory, lora_int_id, split_model
from tokenbus.topics import Topics, reply_batch_key
from tokenbus.tracing import (
    ATTR_OUTCOME,
    ATTR_TENANT,
    extract,
    inject,
    span_attributes,
    with_path,
    work_item_attributes,
)
from tokenbus.usage import usage_of

Headers = Any
"""A record's headers as Faust or aiokafka give them: (name, bytes) pairs or a mapping."""


class Record(NamedTuple):
    """A request or cancel record as the handlers take it (``app`` reads one off each
    Faust message)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers = None


log = logging.getLogger(__name__)

FORWARD_RETRY_S = 0.5
"""How long a request whose forward the broker did not take waits before it queues again."""
STALL_WARN_S = 10.0
"""Requests waiting with nothing forwarded this long is logged (then every as long)."""


class TopicLookup(Protocol):
    """Whether a topic exists, found out without making it, as of an answer asked after
    the lookup began (``tokenbus.metadata.ExistingTopics``); ``assume_on_failure``: the
    answer when the broker gives none."""

    async def __call__(self, topic: str, *, assume_on_failure: bool = False) -> bool: ...


class WindowStore(Protocol):
    """Quota windows, by ``window.window_key``: each tenant's, and its batch lines'
    (``<tenant>/batch``). A state loaded is changed in place, from the tenant's
    partition's agent only; its reservations are persisted in the ledger entries the
    dispatcher writes (``ledger.Reserved``), from which a store rebuilds it."""

    def load(self, tenant_id: str) -> WindowState: ...


class ReplyLog(Protocol):
    """Reads back the chunks a request's reply topic holds (see ``tokenbus.replies``)."""

    def read(
        self, *, reply_to: str, tenant_id: str, request_id: str, since: datetime
    ) -> Awaitable[list[Chunk]]: ...


class ForwardLog(Protocol):
    """Reads back records the job forwarded to workers (see ``tokenbus.forwards``): the
    value at each (topic, partition, offset) that still holds one."""

    def read(
        self, places: list[tuple[str, int, int]]
    ) -> Awaitable[dict[tuple[str, int, int], bytes]]: ...


def _header_pairs(headers: Headers) -> list[tuple[str, bytes]]:
    if not headers:
        return []
    pairs = headers.items() if hasattr(headers, "items") else headers
    return [(k, v) for k, v in pairs if isinstance(v, bytes)]


def header(headers: Headers, name: str) -> bytes | None:
    """The first value of header ``name`` (case-insensitive), or None."""
    if not headers:
        return None
    pairs = headers.items() if hasattr(headers, "items") else headers
    for key, value in pairs:
        if isinstance(key, bytes):
            key = key.decode("latin-1")
        if key.lower() == name:
            return value if isinstance(value, bytes | None) else str(value).encode()
    return None


class Outcome(Enum):
    FORWARDED = "forwarded"
    REFUSED = "refused"
    CANCELLED = "cancelled"
    DUPLICATE = "duplicate"
    """A redelivered request that already ran to completion: nothing to do."""


Key = tuple[str, str]
"""(tenant, request_id): request ids are unique only within a tenant."""


@dataclass
class _Waiting:
    request: WorkItem
    done: asyncio.Future[Outcome]
    received_at: float
    """When it was queued, on the monotonic clock: its queue wait starts here."""
    queued_ns: int
    """The same instant on the wall clock, in ns: its ``job.queue`` span starts here."""
    trace: Context | None = None
    """The request's ``job.admit`` span (or, resent, its previous attempt's trace)."""
    home: int | None = None
    """The partition of the tenant's requests it came in on: its ledger entry's."""


@dataclass
class Admitted:
    """A request ``Dispatcher.admit`` queued: ``Dispatcher.finish`` awaits its forward."""

    waiting: _Waiting


_Picked = tuple[WorkItem, str]
"""A request as forwarded to its worker, and that worker's topic."""


@dataclass
class _InFlight:
    request: WorkItem
    """The copy forwarded to the worker; never swapped while the entry is held (the
    table counts the entry by it: ``stream_jobs.in_flight``)."""
    cancelled: bool = False
    trace: Context | None = None
    """Its trace, so that an attempt sent again after a worker loss joins it."""
    home: int | None = None
    """The partition of the tenant's requests (its ledger entry's)."""
    forwarded: bool = False
    """The broker acknowledged its forward, and its FORWARDED entry is written: until
    then, the ledger holds nothing of it (``Dispatcher._held_entry``)."""

    @property
    def worker(self) -> tuple[str | None, str | None]:
        return (self.request.worker_id, self.request.worker_incarnation)


def _facets(flight: _InFlight) -> Facets:
    request = flight.request
    return Facets(request.model, request.priority == BATCH_CLASS, request.batch_id is not None)


@dataclass
class DispatchMetrics:
    num_admitted: int = 0
    num_rejected_quota: int = 0
    num_rejected_budget: int = 0
    num_budget_alerts: int = 0
    num_rejected_invalid: int = 0
    num_unauthenticated: int = 0
    """Requests refused for their credential: missing, invalid, expired, unknown tenant."""
    num_forbidden: int = 0
    """Requests whose credential may not do what they ask: another tenant, another's
    reply topic, a key that is not their tenant."""
    num_reply_topic_missing: int = 0
    """Requests whose reply topic does not exist: dead-lettered, never run."""
    num_shed: int = 0
    num_capped: int = 0
    num_no_worker: int = 0
    num_cancelled_waiting: int = 0
    num_dead_letters: int = 0
    num_dispatched: int = 0
    num_forward_retries: int = 0
    """Forwards (or answers) the broker did not take: each request waits again."""
    num_duplicates: int = 0
    num_tier_changes: int = 0
    num_workers_lost: int = 0
    num_redispatched: int = 0
    num_resumed: int = 0
    num_recovered_finished: int = 0
    num_superseded: int = 0
    """Attempts sent again after a worker loss, dropped because the attempt before them,
    only presumed lost, finished after all (its stream whole, its usage reported)."""
    num_adopted: int = 0
    """Requests in flight that an earlier run of the job (or another instance) forwarded."""
    num_adoptions_failed: int = 0
    """FORWARDED ledger entries whose forwarded copy could not be read back."""
    num_affine: int = 0
    num_adapter_affine: int = 0
    """Adapter requests sent to a worker that already held their adapter."""
    num_batch_admitted: int = 0
    """Batch lines (requests with a ``batch_id``) admitted by their tenant's batch budget."""
    num_batch_rejected_quota: int = 0
    """Batch lines refused by their tenant's batch TPM/RPM window (they are retried)."""
    num_batch_rejected_invalid: int = 0
    """Requests with a ``batch_id`` refused for not being class 2."""
    num_prompt_counts_vouched: int = 0
    """Prompts whose count a tokenbus service made and vouched for on the record."""
    num_prompt_vouches_refused: int = 0
    """Records with a prompt count the job did not believe (not a service's credential,
    or a MAC that is not the record's): it counted those prompts itself."""
    tier: int = 0
    tier_changed_at: float = 0.0
    num_waiting: int = 0
    num_in_flight: int = 0
    capacity: int = 0
    queue_ms_by_class: dict[int, list[float]] = field(default_factory=lambda: {0: [], 1: [], 2: []})
    lag_ms: dict[str, list[float]] = field(default_factory=dict)
    """How stale the job's view is, per input: from a record's production (or, for
    ``usage_since_finish``, the request's end on the worker) to the job acting on it."""
    workers: dict[str, WorkerStatus] = field(default_factory=dict)
    """Each live worker's last heartbeat."""
    quota_refusals: dict[str, int] = field(default_factory=dict)
    """Window refusals by reason: ``tpm``, ``rpm``, ``tpm_burst``, ``too_large``."""

    def note_quota_refusal(self, reason: str) -> None:
        kind = reason if reason in ("tpm", "rpm") else reason.split(":")[0]
        if kind != "tpm_burst" and kind not in ("tpm", "rpm"):
            kind = "too_large"  # one request's tokens exceed the whole minute's
        self.quota_refusals[kind] = self.quota_refusals.get(kind, 0) + 1


class Dispatcher:
    """Admits requests and forwards them by class and fair share as capacity frees up."""

    def __init__(
        self,
        settings: Settings,
        publish: Publish,
        store: WindowStore,
        replies: ReplyLog,
        ledger: Ledger,
        *,
        authenticator: Authenticator | None = None,
        clock: Clock = SYSTEM_CLOCK,
        spend: SpendStore | None = None,
        pricer: Pricer | None = None,
        tracer: Tracer | None = None,
        forwards: ForwardLog | None = None,
        home_of: Callable[[bytes], int] | None = None,
        knows_topic: TopicLookup | None = None,
    ) -> None:
        """``forwards``: reads back forwarded requests, for ``adopt``. ``home_of``: the
        partition a tenant's records belong on, given its key (the job's: Kafka's
        default partitioner over ``num_partitions``); None checks no partition.
        ``knows_topic``: whether a topic exists, found out without making it
        (``tokenbus.metadata.ExistingTopics``): a refusal of a producer nobody
        identified goes only to one that does, and a tenant's request is admitted only
        with a reply topic that does; None: every topic does."""
        self._home_of = home_of
        self._knows_topic = knows_topic
        self._settings = settings
        self._publish = publish
        self._tracer = tracer or NoOpTracer()
        self._store = store
        self._replies = replies
        self._ledger = ledger
        self._clock = clock
        self._topics = Topics(settings.topic_prefix)
        self._tenants: TenantDirectory = settings.tenant_directory()
        self._auth = authenticator or settings.authenticator()
        self._counter = PromptCounter(settings.model_dir / "tokenizer.json")
        self._registry = WorkerRegistry(dead_after_s=settings.worker_dead_after_s)
        self._queue: FairQueue[_Waiting] = FairQueue()
        self._waiting: dict[Key, _Waiting] = {}
        self._in_flight: InFlightTable[_InFlight] = InFlightTable(_facets)
        self._forwards = forwards
        self._orphans: dict[Key, float] = {}
        """Adopted requests whose worker run was not seen live yet: since when."""
        self._routing = RoutingWeights(
            kv=settings.route_weight_kv,
            queue=settings.route_weight_queue,
            load=settings.route_weight_load,
            kv_threshold=settings.route_kv_threshold,
            priority_bonus=settings.route_priority_bonus,
            affinity_margin=settings.affinity_margin,
            adapter_margin=settings.adapter_margin,
        )
        self._affinity = SessionAffinity(settings.affinity_sessions)
        self._recoveries: set[asyncio.Task[None]] = set()
        self._forwarding: set[asyncio.Task[None]] = set()
        self._tiers = TierPolicy(
            cap_above=settings.tier_cap_above,
            shed_above=settings.tier_shed_above,
            capped_max_tokens=settings.tier_capped_max_tokens,
        )
        self._tier = Tier.NORMAL
        self._batch_yield = create_batch_yield(
            settings.batch_yield_seats_per_worker, settings.batch_yield_hold_s
        )
        self._peak_hours = PeakHours.parse(settings.peak_hours, settings.peak_hours_tz)
        # Budgets price requests as billing does (same prices, peak hours, charge shares).
        self._pricer = pricer or Pricer(load_price_book(settings), self._peak_hours)
        self._spend: SpendStore = spend if spend is not None else MemorySpendStore()
        self._budgets = BudgetBook(
            Budget.from_config(config, settings.budget_tz)
            for config in self._tenants.budget_configs()
        )
        self._alerts: list[BudgetAlert] = []
        self._drops: list[CancelRequest] = []
        """``reassigned`` cancels ``observe_usage`` raised, sent by ``publish_raised``."""
        self._owed: list[tuple[str, str, str, range, Turn]] = []
        """(reply_to, tenant, request_id, seqs): the answers owed to the copies of the
        requests ``observe_usage`` saw end, sent by ``publish_raised``, each with its turn."""
        self._answer_order = AnswerOrder()
        """Answers to one request id go out in the order their seqs were given."""
        self._wake = asyncio.Event()
        self._started_at = clock.monotonic()
        self._last_forward_at = self._started_at
        self._stall_said_at = self._started_at
        self._load = LoadTracker()
        self._load_since = clock.monotonic()
        self.metrics = DispatchMetrics()

    # -- admission (runs in the request's agent: may write the tenant's window) --------
    async def handle_request(self, record: Record) -> Outcome:
        """One request, start to end: ``admit``, then ``finish`` if it was queued."""
        admitted = await self.admit(record)
        if isinstance(admitted, Outcome):
            return admitted
        return await self.finish(admitted)

    async def admit(self, record: Record) -> Outcome | Admitted:
        """Judges a request and queues it, without waiting for its forward: an
        ``Outcome`` when it has had its answer here, else the ``Admitted`` request that
        ``finish`` sees through.

        Traced as ``job.admit``, under the trace context the record carries; its
        ``tokenbus.outcome`` says what became of the request. An admitted request's path
        to its first token (``tokenbus.span_path``) goes on here: ``bus.request`` from
        where the sender's path stood to now, ``job.admit``, then ``job.queue`` from the
        instant admission ended."""
        pairs = _header_pairs(record.headers)
        parent = extract(pairs)
        taken_ns = self._wall_ns()
        span = start_span(
            self._tracer, "job.admit", context=parent, kind=SpanKind.CONSUMER, start_time=taken_ns
        )
        try:
            result = await self._admit(span, record)
        except BaseException as exc:
            span.set_status(StatusCode.ERROR, type(exc).__name__)
            span.end()
            raise
        if isinstance(result, Admitted):
            span.set_attribute(ATTR_OUTCOME, "admitted")
            waiting = result.waiting
            waiting.trace = set_span_in_context(span)
            if span.is_recording():
                # Filed under the proven tenant, like job.admit (known only now).
                tenant = {ATTR_TENANT: waiting.request.tenant_id}
                hop_span(
                    self._tracer, "bus.request", path_ns(pairs), taken_ns, tenant, context=parent
                )
            waiting.queued_ns = max(taken_ns, self._wall_ns())
            span.end(end_time=waiting.queued_ns)
            return result
        span.set_attribute(ATTR_OUTCOME, result.value)
        span.end()
        return result

    async def _admit(self, span: Span, record: Record) -> Outcome | Admitted:
        _, partition, _, key, value, headers = record
        limit = self._settings.max_request_record_bytes
        if value is not None and len(value) > limit:
            # Its forward would not fit a record: refused here, not retried there.
            self.metrics.num_rejected_invalid += 1
            message = (
                f"the request record is {len(value)} bytes; the job admits at most {limit} "
                "(TOKENBUS_MAX_REQUEST_RECORD_BYTES)"
            )
            await self._refuse_unreadable(record, message, code="request_too_large")
            return Outcome.REFUSED
        try:
            request = decode(InferenceRequest, value)
        except SchemaError as exc:
            await self._refuse_unreadable(record, str(exc))
            return Outcome.REFUSED

        now = self._clock.time()
        try:
            principal = self._auth.authenticate(header(headers, "authorization"))
        except AuthError as exc:
            self.metrics.num_unauthenticated += 1
            claimed = request.tenant_id or (key or b"").decode("utf-8", "replace")
            await self._refuse_unproven(record, request, claimed, exc)
            return Outcome.REFUSED
        item = self._work_item(request, principal, now)
        ident = (item.tenant_id, item.request_id)
        # Under the tenant the credential proved: an unproven request's spans file under
        # no tenant, so nobody can write into another tenant's traces.
        span.set_attributes(work_item_attributes(item))
        # This request's task (one per request in the admit agent) logs with its fields.
        bind_request(
            tenant=item.tenant_id,
            request_id=item.request_id,
            session_id=item.session_id,
            batch_id=item.batch_id,
            trace_id=f"{span.get_span_context().trace_id:032x}",
        )
        owns_reply_topic = principal.owns_reply_topic(item.reply_to)
        misplaced = self._partition_problem(principal.tenant_id, partition)
        if key != principal.tenant_id.encode() or misplaced is not None:
            # On another tenant's partition: nothing of this tenant's (its window, its
            # ledger) may be written from here, nor a usage row its id could not match
            # later. The producer hears of it, and may send it again keyed right. (On
            # a partition its key does not hash to, another job instance may hold its
            # tenant: admitted there and here, it could run twice, and on two quotas.)
            self.metrics.num_forbidden += 1
            error = self._identity_problem(request, principal, key) or misplaced
            assert error is not None
            await self._dead_letter(record, f"{error.code}: {error.message}")
            if (
                owns_reply_topic
                and not self._known(*ident)
                and await self._reply_topic_exists(item.reply_to)
            ):
                await self._reply_only(item.reply_to, item.tenant_id, item.request_id, 0, error)
            return Outcome.REFUSED
        if owns_reply_topic and not await self._reply_topic_exists(item.reply_to):
            # Its tokens, or any answer, would make the topic (a broker that makes topics
            # on demand) or wait for it (one that does not): a topic a request, or
            # every fresh name a tenant sends, on the broker; or a run nobody can read.
            # Refused before anything of the tenant's is written: no window, budget,
            # ledger entry or usage row (this id may be a run's), so once the producer
            # has made its topic it may send the request again as it was.
            self.metrics.num_reply_topic_missing += 1
            await self._dead_letter(
                record,
                f"reply_topic_missing: the reply topic {item.reply_to!r} does not exist; "
                "create it before sending requests that name it",
            )
            return Outcome.REFUSED
        self._ledger.sweep(item.tenant_id, now)
        entry = self._ledger.get(*ident) or self._held_entry(item, now)
        in_memory = self._holds(ident)
        verdict = judge(entry, item.reply_to, now, in_memory=in_memory)
        if verdict in (Verdict.SAME_STREAM, Verdict.DUPLICATE):
            # The id has its run (or its answer): this copy changes nothing, and writes
            # no UsageEvent (its billing key would be the run's).
            self.metrics.num_duplicates += 1
            if not owns_reply_topic:
                await self._dead_letter(record, self._not_owned(principal, item.reply_to))
            elif verdict is Verdict.DUPLICATE:
                assert entry is not None
                done = entry.state is State.DONE
                turn = self._answer_order.take(ident)
                if done:  # after the stream and every answer before this one
                    entry = entry.answered_once_more()
                    self._ledger.put(*ident, entry)
                async with turn:
                    await self._answer_duplicate(item, entry.last_seq if done else 0, done)
            else:
                # Its producer reads the one stream; this copy is answered after it, once
                # the request has ended (``ledger.ended``), for it may have been sent
                # after the stream's last chunk.
                assert entry is not None  # held here: ``_held_entry``
                if entry.copies < MAX_COPIES:
                    self._ledger.put(*ident, entry.with_copy())
                else:  # a flood: kept where an operator finds it, and nothing more
                    await self._dead_letter(
                        record,
                        f"duplicate_request: more than {MAX_COPIES} copies of request "
                        f"{item.request_id!r} while it runs; the first {MAX_COPIES} are "
                        "answered after its stream",
                    )
            return Outcome.DUPLICATE

        error = self._identity_problem(request, principal, key)
        if error is not None and owns_reply_topic:
            self.metrics.num_forbidden += 1
            return await self._turn_down(item, error, now)
        if not owns_reply_topic:
            # Not the producer's topic: no chunk goes there, whoever owns it.
            self.metrics.num_forbidden += 1
            await self._dead_letter(record, self._not_owned(principal, item.reply_to))
            await self._publish_rejected(item, "reply_topic_forbidden")
            self._remember(item, State.DONE, now)
            return Outcome.REFUSED

        tenant = principal.tenant
        num_prompt = self._prompt_tokens(request, principal, record)
        problem = self._check_tenant_rules(item, principal, num_prompt)
        if problem is not None:
            self.metrics.num_rejected_invalid += 1
            if item.batch_id is not None:
                self.metrics.num_batch_rejected_invalid += 1
            return await self._turn_down(item, problem, now)

        if item.batch_id is not None:
            # Not overload demand (``_update_tier``), so bounded here: the runner retries.
            capacity = self._capacity()
            per_seat = self._settings.batch_max_waiting_per_seat
            if self._queue.num_filler >= per_seat * max(1, capacity):
                return await self._shed(
                    item,
                    f"{self._queue.num_filler} batch lines already wait for the fleet's "
                    f"{capacity} seats; send this one again later",
                    now,
                )
        priority = item.priority
        self._update_tier(extra_waiting=int(item.batch_id is None))
        action = apply_tier(self._tiers, self._tier, priority, item.sampling.max_tokens)
        if action.shed:
            return await self._shed(
                item,
                f"the fleet is above {self._tiers.shed_above:.0%} of capacity; "
                "batch requests are shed until it recovers",
                now,
                tier=self._tier,
            )
        updates: dict[str, object] = {}
        if item.overload_tier != self._tier:
            updates["overload_tier"] = int(self._tier)
        if action.max_tokens is not None:
            self.metrics.num_capped += 1
            updates["sampling"] = item.sampling.model_copy(update={"max_tokens": action.max_tokens})
            updates["flags"] = [*item.flags, "max_tokens_capped"]
        if updates:  # most requests: at tier 0 and not capped, the item as it is
            item = item.model_copy(update=updates)

        # Spend budgets first: a refusal here charges nothing; a window refusal below
        # gives the budgets their reservation back.
        subject = Subject(item.tenant_id, item.model, principal.key_sha256)
        applicable = self._budgets.applicable(subject)
        if principal.quota_balance is not None:
            credential = principal.key_sha256 or principal.credential_id
            applicable.append(budgets.token_budget(credential, principal.quota_balance))
        if applicable:
            cost = budgets.max_cost_nanos(self._pricer, item, num_prompt)
            spend_verdict = budgets.reserve(
                self._spend, applicable, item.tenant_id, item.request_id, cost, item.admitted_at
            )
            if not spend_verdict.admitted:
                self.metrics.num_rejected_budget += 1
                await self._turn_down(item, self._budget_refusal(item, spend_verdict, cost), now)
                assert spend_verdict.refused_by is not None
                await self._alert_refused(spend_verdict.refused_by, item)
                return Outcome.REFUSED

        # A batch line is charged to its tenant's batch window, never to the interactive
        # one: a million lines cannot take the tenant's own minute, nor another's batch.
        # Its budget is tokens alone (a line costs a token at least, so an RPM equal to
        # the TPM never binds first): the tenant's RPM is for its interactive traffic.
        window = window_key(item.tenant_id, item.batch_id)
        if item.batch_id is None:
            limits = Limits(tpm=tenant.tpm, rpm=tenant.rpm, burst_s=tenant.burst_s)
        else:
            batch_tpm = self._batch_tpm(tenant.batch_tpm)
            limits = Limits(tpm=batch_tpm, rpm=batch_tpm, burst_s=tenant.burst_s)
        state = self._store.load(window)
        # The quota counts cost-weighted tokens, by the same rule billing prices with; the
        # precision is not known before a worker is picked, so settling corrects it.
        weight = cost_weight(num_prompt, "", item.admitted_at, self._peak_hours)
        decision = reserve(
            state,
            item.request_id,
            math.ceil((num_prompt + item.sampling.max_tokens) * weight),
            limits,
            now,
        )
        if not decision.admitted:
            budgets.release(self._spend, item.tenant_id, item.request_id)
            self.metrics.num_rejected_quota += 1
            if item.batch_id is not None:
                self.metrics.num_batch_rejected_quota += 1
            self.metrics.note_quota_refusal(decision.reason)
            by_requests = decision.reason == "rpm"
            return await self._turn_down(
                item,
                ErrorInfo(
                    code="quota_exceeded",
                    message=(
                        f"tenant {item.tenant_id!r}"
                        f"{' (batch budget)' if item.batch_id is not None else ''}: "
                        f"{decision.reason}; used "
                        f"{decision.num_tokens_used} of {limits.tpm} tokens and "
                        f"{decision.num_requests_used} of {limits.rpm} requests in the last 60 s"
                    ),
                    retry_after_s=round(decision.retry_after_s, 3) or None,
                    limit_kind="requests" if by_requests else "tokens",
                    num_limit=limits.rpm if by_requests else limits.tpm,
                    num_remaining=max(
                        0,
                        limits.rpm - decision.num_requests_used
                        if by_requests
                        else limits.tpm - decision.num_tokens_used,
                    ),
                ),
                now,
            )
        if decision.duplicate:
            # Ran and settled within the window, its ledger entry gone: still a repeat
            # (its last seq unknown: the answer takes seq 0).
            self.metrics.num_duplicates += 1
            await self._answer_duplicate(item, 0, True)
            return Outcome.DUPLICATE
        # No ledger entry yet: the request's event stays unacked until its forward (or
        # its answer), so a job that dies first has it redelivered and admits it again
        # (its reservation still in the window, so not charged twice); meanwhile a copy
        # is judged against the request held here (``_held_entry``). The ledger's first
        # record of it is FORWARDED, with where it runs (``_note_forward``).
        self.metrics.num_admitted += 1
        if item.batch_id is not None:
            self.metrics.num_batch_admitted += 1

        waiting = self._new_waiting(item, home=partition)
        self._enqueue(waiting, priority, tenant.weight, num_prompt)
        return Admitted(waiting)

    async def finish(self, admitted: Admitted) -> Outcome:
        """Waits for an admitted request's forward (or its answer), then records it.
        Runs in the context of the request's event: the table writes land on the
        tenant's partition."""
        item = admitted.waiting.request
        outcome = await admitted.waiting.done
        # A forward is in the ledger already (``_send``), with where it runs.
        if outcome is not Outcome.FORWARDED:  # cancelled while waiting, or refused: answered
            turn = self._answer_order.take((item.tenant_id, item.request_id))
            owed = self._remember(item, State.DONE, self._clock.time(), last_seq=item.resume_seq)
            async with turn:
                await self._answer_copies(item.reply_to, item.tenant_id, item.request_id, owed)
            # Never ran: give the tenant its reservation back (in this agent's context).
            window = window_key(item.tenant_id, item.batch_id)
            state = self._store.load(window)
            release(state, item.request_id, self._clock.time())
            budgets.release(self._spend, item.tenant_id, item.request_id)
        return outcome

    def _batch_tpm(self, configured: int | None) -> int:
        return configured if configured is not None else self._settings.default_batch_tpm

    # -- spend budgets ------------------------------------------------------------------
    def _budget_refusal(
        self, item: WorkItem, verdict: budgets.BudgetDecision, cost: int
    ) -> ErrorInfo:
        """OpenAI's answer to a spent budget, ``insufficient_quota``, naming the budget."""
        budget = verdict.refused_by
        assert budget is not None
        left = max(0, budget.num_limit_nanos - verdict.num_used_nanos)
        retry = (
            (verdict.resets_at - item.admitted_at).total_seconds() if verdict.resets_at else None
        )
        return ErrorInfo(
            code="insufficient_quota",
            message=(
                f"budget {budget.budget_id} is spent: {budgets.to_units(left)} of "
                f"{budgets.to_units(budget.num_limit_nanos)} cost units left this period, and "
                f"this request may cost up to {budgets.to_units(cost)} (its prompt plus "
                f"max_tokens); a smaller max_tokens may fit"
            ),
            retry_after_s=round(retry, 3) if retry else None,
        )

    def _alert(
        self, budget: Budget, tenant_id: str, at: datetime, threshold: int, reason: str
    ) -> BudgetAlert:
        bucket = budget.period.bucket_of(at)
        start, end = budget.period.bounds(bucket)
        _, settled = budgets.held_in(self._spend, budget, at)
        self._spend.fire(tenant_id, budget.budget_id, bucket, threshold)
        self.metrics.num_budget_alerts += 1
        return BudgetAlert(
            alert_id=f"{budget.budget_id}|{bucket}|{threshold}",
            budget_id=budget.budget_id,
            entity=budget.entity,
            tenant_id=tenant_id,
            period_start=start,
            period_end=end,
            threshold=threshold,
            limit_units=str(budgets.to_units(budget.num_limit_nanos)),
            spent_units=str(budgets.to_units(settled)),
            enforce="hard" if budget.hard else "soft",
            reason="refused" if reason == "refused" else "threshold",
            fired_at=datetime.fromtimestamp(self._clock.time(), UTC),
        )

    async def _alert_refused(self, budget: Budget, item: WorkItem) -> None:
        """A hard budget's first refusal of a period is its 100% alert, if not sent yet;
        a budget without thresholds (a token's balance) does not alert."""
        bucket = budget.period.bucket_of(item.admitted_at)
        if not budget.thresholds or 100 in self._spend.fired(budget.budget_id, bucket):
            return
        alert = self._alert(budget, item.tenant_id, item.admitted_at, 100, "refused")
        await self._publish(self._topics.budget_alerts, item.tenant_id.encode(), encode(alert))

    def _settle_budgets(self, usage: UsageEvent) -> None:
        counters = budgets.settle(
            self._spend,
            usage.tenant_id,
            usage.request_id,
            budgets.billed_nanos(self._pricer, usage),
            self._clock.time() + self._settings.request_dedupe_s,
            usage.attempt,
        )
        for budget_id, _ in counters:
            budget = self._budgets.get(budget_id)
            if budget is None:
                continue  # removed since: its spend is kept, nothing alerts
            for threshold in budgets.due_thresholds(self._spend, budget, usage.created_at):
                reason = "threshold"
                self._alerts.append(
                    self._alert(budget, usage.tenant_id, usage.created_at, threshold, reason)
                )

    def _supersede(self, ident: Key, attempt: int) -> None:
        """Attempt ``attempt`` of ``ident`` ended (its usage came). If the job had
        presumed it lost and holds a later attempt, in flight or waiting, the presumption
        was wrong: the worker was only slow (its heartbeats late) and reported before the
        ``reassigned`` cancel reached it. A worker reports an attempt only once its last
        chunk is acknowledged, so the client's stream has ended and this usage bills it.
        The later attempt would stream and bill the same tokens again: it is dropped here,
        and its worker drops it without a chunk or a usage event more (the cancel goes out
        from ``publish_raised``)."""
        flight = self._in_flight.get(ident)
        waiting = self._waiting.get(ident)
        if flight is not None and flight.request.attempt > attempt:
            later = flight.request
            del self._in_flight[ident]
            self._orphans.pop(ident, None)
        elif waiting is not None and waiting.request.attempt > attempt:
            later = waiting.request
            del self._waiting[ident]
            self._queue.remove(_queue_key(ident))
            if not waiting.done.done():
                waiting.done.set_result(Outcome.CANCELLED)
        else:
            return
        self._drops.append(
            CancelRequest(
                request_id=later.request_id,
                tenant_id=later.tenant_id,
                reason=REASSIGNED,
                attempt=later.attempt,
            )
        )
        self.metrics.num_superseded += 1
        log.warning(
            "%s/%s: attempt %d, presumed lost, finished after all; attempt %d is dropped",
            *ident,
            attempt,
            later.attempt,
        )
        self._update_tier()
        self._wake.set()

    async def publish_raised(self) -> None:
        """Sends what ``observe_usage`` raised: the answers owed to copies of the requests
        that ended, budget alerts, and the ``reassigned`` cancels of attempts superseded
        (``_supersede``); the usage agent calls it next."""
        owed, self._owed = self._owed, []
        try:
            for reply_to, tenant_id, request_id, seqs, turn in owed:
                async with turn:
                    await self._answer_copies(reply_to, tenant_id, request_id, seqs)
        finally:
            for *_, turn in owed:  # a send failed: the later answers must not wait on these
                turn.end()
        drops, self._drops = self._drops, []
        for drop in drops:
            await self._publish(self._topics.aborts, drop.tenant_id.encode(), encode(drop))
        alerts, self._alerts = self._alerts, []
        for alert in alerts:
            await self._publish(self._topics.budget_alerts, alert.tenant_id.encode(), encode(alert))

    def observe_budget(self, key: bytes | None, value: bytes | None) -> None:
        """A runtime change from the budgets topic: a ``BudgetConfig``, or none to remove."""
        budget_id = (key or b"").decode("utf-8", "replace")
        if not value:
            self._budgets.put(budget_id, None)
            return
        try:
            config = BudgetConfig.model_validate_json(value)
            budget = Budget.from_config(config, self._settings.budget_tz)
        except ValueError as exc:
            log.warning("ignoring budget %r: %s", budget_id, exc)
            return
        if budget.budget_id != budget_id:
            log.warning("ignoring budget keyed %r: its id is %r", budget_id, budget.budget_id)
            return
        self._budgets.put(budget_id, budget)

    def budget_rows(self) -> list[dict[str, object]]:
        """Each budget this instance holds spend for, now: for /metrics and ``/budgets``."""
        now = datetime.fromtimestamp(self._clock.time(), UTC)
        rows: list[dict[str, object]] = []
        for budget in self._budgets:
            held, settled = budgets.held_in(self._spend, budget, now)
            rows.append(
                {
                    "budget_id": budget.budget_id,
                    "entity": budget.entity,
                    "enforce": "hard" if budget.hard else "soft",
                    "period": budget.period.bucket_of(now),
                    "limit": str(budgets.to_units(budget.num_limit_nanos)),
                    "spent": str(budgets.to_units(settled)),
                    "reserved": str(budgets.to_units(held - settled)),
                    "remaining": str(budgets.to_units(budget.num_limit_nanos - held)),
                }
            )
        return rows

    def budget_buckets(self) -> list[dict[str, object]]:
        """Settled spend per budget and bucket, with the bucket's instants: what the
        reconciliation compares with ClickHouse."""
        rows: list[dict[str, object]] = []
        for budget_id, bucket, held, settled in self._spend.buckets():
            # Its id names its period: a token's balance or a removed budget has bounds too.
            _, period, tz = parse_budget_id(budget_id)
            start, end = budgets.Period.parse(period, tz or "UTC").bounds(bucket)
            rows.append(
                {
                    "budget_id": budget_id,
                    "bucket": bucket,
                    "start": start.isoformat(),
                    "end": end.isoformat(),
                    "spent": str(budgets.to_units(settled)),
                    "reserved": str(budgets.to_units(held - settled)),
                }
            )
        return rows

    def _prompt_tokens(
        self, request: InferenceRequest, principal: Principal, record: Record
    ) -> int:
        """The prompt's length in the model's tokens: the count a tokenbus service (the
        bridge) made and vouched for on this very record (``tokenbus.prompt_vouch``),
        else the job's own."""
        vouch = header(record.headers, VOUCH_HEADER)
        secret = self._settings.bus_service_secret
        if vouch is not None:
            count = None
            if principal.service and secret:
                count = vouched(secret, record.value or b"", vouch)
            if count is not None:
                self.metrics.num_prompt_counts_vouched += 1
                return count
            # Not a service's record, or not this record's count: counted here instead.
            self.metrics.num_prompt_vouches_refused += 1
        return self._counter.count(request)

    def _work_item(self, request: InferenceRequest, principal: Principal, now: float) -> WorkItem:
        """The request as the job hands it on: every field a producer could forge is
        derived here from the credential and the job's own clock."""
        tenant = principal.tenant
        admitted = datetime.fromtimestamp(now, UTC)
        skew = timedelta(seconds=self._settings.created_at_skew_s)
        created = min(max(request.created_at or admitted, admitted - skew), admitted)
        salt = f"group:{tenant.sharing_group}" if tenant.sharing_group else tenant.tenant_id
        # The adapter comes from the tenants file, by the name the credential's tenant
        # may use; one it may not use stays in ``model``, which the tenant rules refuse.
        model, adapter = request.model, None
        config = tenant.adapter(request.model)
        if config is not None:
            model, name = split_model(request.model)
            assert name is not None
            adapter = Adapter(
                name=name, path=config.path, lora_int_id=lora_int_id(name, config.path)
            )
        return WorkItem(
            request_id=request.request_id,
            session_id=request.session_id or request.request_id,
            tenant_id=tenant.tenant_id,
            # A tenant cannot buy a better class than its config (or token) gives it.
            priority=max(request.priority, tenant.priority_class),
            model=model,
            adapter=adapter,
            prompt=request.prompt,
            messages=request.messages,
            sampling=request.sampling,
            reply_to=request.reply_to,
            created_at=created,
            admitted_at=admitted,
            cache_salt=salt,
            flags=list(principal.flags),
            key_sha256=principal.key_sha256,
            batch_id=request.batch_id,
        )

    @staticmethod
    def _identity_problem(
        request: InferenceRequest, principal: Principal, key: bytes | None
    ) -> ErrorInfo | None:
        if request.tenant_id is not None and request.tenant_id != principal.tenant_id:
            return ErrorInfo(
                code="tenant_mismatch",
                message=f"the credential is tenant {principal.tenant_id!r}'s; "
                f"the request names {request.tenant_id!r}",
            )
        if key != principal.tenant_id.encode():
            # Co-partitioning: a tenant's window lives on the partition of its key.
            return ErrorInfo(
                code="invalid_key",
                message=f"request records are keyed by their tenant id "
                f"({principal.tenant_id!r}); this one's key is {key!r}",
            )
        return None

    def _partition_problem(self, tenant_id: str, partition: int) -> ErrorInfo | None:
        if self._home_of is None:
            return None
        home = self._home_of(tenant_id.encode())
        if partition == home:
            return None
        return ErrorInfo(
            code="invalid_partition",
            message=f"tenant {tenant_id!r}'s records belong on partition {home} (Kafka's "
            f"default partitioner, murmur2 of the key); this one is on {partition}",
        )

    async def _turn_down(
        self,
        item: WorkItem,
        error: ErrorInfo,
        now: float,
        tier: Tier = Tier.NORMAL,
        *,
        home: int | None = None,
    ) -> Outcome:
        """Refuses a request on its tenant's partition (``home``, outside its event): the
        id has had its answer. The ledger holds that before the answer goes out
        (``_remember_durably``); the copies taken while it waited are answered after it."""
        turn = self._answer_order.take((item.tenant_id, item.request_id))
        async with turn:
            owed = await self._remember_durably(item, now, item.resume_seq, home=home)
            await self._refuse(item, error, tier)
            await self._answer_copies(item.reply_to, item.tenant_id, item.request_id, owed)
        return Outcome.REFUSED

    def _check_tenant_rules(
        self, item: WorkItem, principal: Principal, num_prompt: int
    ) -> ErrorInfo | None:
        tenant = principal.tenant
        if item.batch_id is not None and item.priority != 2:
            # The batch window and the batch price are for class 2 work only: a batch id
            # must not buy them for interactive traffic.
            return ErrorInfo(
                code="invalid_request",
                message=f"batch_id is for batch lines, which run at priority 2; this "
                f"request runs at priority {item.priority} (send it at priority 2, or "
                "without batch_id)",
            )
        if not tenant.may_use(item.requested_model):
            return ErrorInfo(
                code="model_not_allowed",
                message=f"tenant {item.tenant_id!r} may not use {item.requested_model!r}",
            )
        if num_prompt > tenant.max_prompt_tokens:
            return ErrorInfo(
                code="prompt_too_long",
                message=f"prompt has {num_prompt} tokens; tenant "
                f"{item.tenant_id!r} allows {tenant.max_prompt_tokens}",
            )
        if item.sampling.max_tokens > tenant.max_output_tokens:
            return ErrorInfo(
                code="invalid_request",
                message=f"sampling.max_tokens {item.sampling.max_tokens} is above "
                f"the tenant's max_output_tokens {tenant.max_output_tokens}",
            )
        return None

    @staticmethod
    def _not_owned(principal: Principal, reply_to: str) -> str:
        return (
            f"reply_to {reply_to!r} is not a reply topic of this credential: "
            f"its reply topics start with {principal.reply_prefix!r}"
        )

    async def _remember_durably(
        self, item: WorkItem, now: float, last_seq: int = 0, *, home: int | None = None
    ) -> range:
        """``_remember`` of a ``DONE`` entry, returning once the broker holds it. For an
        answer that tells the client to try again (under a new id: a batch line's next
        one), which must not be seen before the ledger says this id had its answer: a job
        killed between the two would otherwise take the id's redelivered request as new,
        and run it beside its retry."""
        previous = self._ledger.get(item.tenant_id, item.request_id)
        entry, owed = ended(previous, self._entry(item, State.DONE, now, last_seq))
        await self._ledger.put_durably(home, item.tenant_id, item.request_id, entry)
        return owed

    def _entry(
        self,
        item: WorkItem,
        state: State,
        now: float,
        last_seq: int,
        forward: Forward | None = None,
    ) -> Entry:
        """A request's entry; while it may run (not DONE), with its reservation as it stands.
        A DONE entry written here is an answer without a run: its reservation is given
        back (``finish``), and the entry carries none."""
        reserved = None
        if state is not State.DONE:
            reserved = self._reserved(window_key(item.tenant_id, item.batch_id), item.request_id)
        expires_at = now + self._settings.request_dedupe_s
        return Entry(state, item.reply_to, expires_at, last_seq, forward, reserved=reserved)

    def _reserved(self, window: str, request_id: str) -> Reserved | None:
        """The request's reservation in ``window``, for its ledger entry."""
        reservation = self._store.load(window).reservations.get(request_id)
        return None if reservation is None else Reserved(window, *reservation)

    def _remember(
        self,
        item: WorkItem,
        state: State,
        now: float,
        last_seq: int = 0,
        *,
        home: int | None = None,
        forward: Forward | None = None,
    ) -> range:
        """Its ledger entry, under the request's event; or, outside it (``home`` given),
        on the tenant's partition ``home``. Returns the seqs of the ``duplicate_request``
        answers owed to copies taken while it ran, if this ends it (``ledger.ended``)."""
        previous = self._ledger.get(item.tenant_id, item.request_id)
        entry = self._entry(item, state, now, last_seq, forward)
        owed = range(0)
        if state is State.DONE:
            entry, owed = ended(previous, entry)
        else:
            entry = carried(previous, entry)
        if home is None:
            self._ledger.put(item.tenant_id, item.request_id, entry)
        else:
            self._ledger.put_at(home, item.tenant_id, item.request_id, entry)
        return owed

    def _held_entry(self, item: WorkItem, now: float) -> Entry | None:
        """The entry of a request this instance holds but the ledger has none of (never
        written before its forward, or forgotten past its dedupe window): ADMITTED while
        it waits or its forward is unacknowledged, FORWARDED once forwarded. None if it
        is not held here. A copy's answer is judged by it, and a copy counted in it
        writes it (``with_copy``): ADMITTED, a job restarted before the forward admits
        the request again (``Verdict.RUN``)."""
        ident = (item.tenant_id, item.request_id)
        waiting = self._waiting.get(ident)
        if waiting is not None:
            return self._entry(waiting.request, State.ADMITTED, now, 0)
        flight = self._in_flight.get(ident)
        if flight is None:
            return None
        state = State.FORWARDED if flight.forwarded else State.ADMITTED
        return self._entry(flight.request, state, now, 0)

    def _holds(self, ident: Key) -> bool:
        """Whether this instance holds the request, waiting or in flight."""
        return ident in self._waiting or ident in self._in_flight

    def _known(self, tenant_id: str, request_id: str) -> bool:
        """Whether the job holds this request, or remembers it: nobody else may answer it."""
        if self._holds((tenant_id, request_id)):
            return True
        entry = self._ledger.get(tenant_id, request_id)
        return entry is not None and entry.expires_at > self._clock.time()

    # -- refusals before a tenant is proven ------------------------------------------------
    async def _dead_letter(self, record: Record, reason: str) -> None:
        self.metrics.num_dead_letters += 1
        await dead_letter_record(
            self._publish, self._topics, record, consumer=self._settings.faust_app_id, reason=reason
        )

    async def _refuse_unreadable(
        self, record: Record, reason: str, *, code: str | None = None
    ) -> None:
        """Dead-lettered; and told on its reply topic, when the record names one and an
        id (so its producer does not wait for its timeout), as ``_refuse_unidentified``
        does."""
        letter = reason if code is None else f"{code}: {reason}"
        try:
            data = orjson.loads(record.value or b"")
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            await self._dead_letter(record, letter)
            return
        request_id, reply_to = data.get("request_id"), data.get("reply_to")
        tenant_id = data.get("tenant_id")
        if not isinstance(tenant_id, str):
            tenant_id = (record.key or b"").decode("utf-8", "replace")
        if not (isinstance(request_id, str) and isinstance(reply_to, str)):
            await self._dead_letter(record, letter)
            return
        error = ErrorInfo(code=code or "invalid_request", message=reason)
        await self._refuse_unidentified(record, letter, tenant_id, request_id, reply_to, error)

    async def _refuse_unproven(
        self,
        record: Record,
        request: InferenceRequest,
        claimed: str,
        exc: AuthError,
    ) -> None:
        """No credential proves who sent this: ``_refuse_unidentified``, under the tenant
        it claims."""
        await self._refuse_unidentified(
            record,
            f"{exc.code}: {exc.message}",
            claimed,
            request.request_id,
            request.reply_to,
            ErrorInfo(code=exc.code, message=exc.message),
        )

    async def _refuse_unidentified(
        self,
        record: Record,
        letter: str,
        tenant_id: str,
        request_id: str,
        reply_to: str,
        error: ErrorInfo,
    ) -> None:
        """A record nobody proved is dead-lettered, and answered on its reply topic under
        the tenant it names unless ``_unanswerable``. Nothing else: no usage row, no
        window, budget or ledger write, for that tenant is only a claim (a rejected row
        under the victim's id would settle the real request's reservation to nothing,
        and take its billing key)."""
        unanswered = await self._unanswerable(tenant_id, request_id, reply_to)
        await self._dead_letter(record, letter if unanswered is None else f"{letter} {unanswered}")
        if unanswered is None:
            await self._reply_only(reply_to, tenant_id, request_id, 0, error)

    async def _unanswerable(self, tenant_id: str, request_id: str, reply_to: str) -> str | None:
        """Why a record nobody proved is not answered (None: it is): its claimed tenant
        must have a tenant's shape, and its request id must not be one the job holds
        (nobody may answer it). Its reply topic must exist: sending to one that does not
        would make it, on a broker that makes topics on demand (Kafka's default), or
        wait for it, on one that does not, holding an admission slot; neither for a
        producer nobody identified."""
        if not TENANT_ID.fullmatch(tenant_id):
            return "(not answered: no tenant id)"
        if not self._topics.is_reply_topic(reply_to):
            return "(not answered: not a reply topic)"
        if self._known(tenant_id, request_id):
            return "(not answered: the request id is in use)"
        if self._knows_topic is not None and not await self._knows_topic(reply_to):
            return "(not answered: no such topic)"
        return None

    async def _reply_topic_exists(self, topic: str) -> bool:
        """A proven tenant's reply topic: found in the answer the job holds (no await),
        else asked about; not refused when the broker does not answer."""
        return self._knows_topic is None or await self._knows_topic(topic, assume_on_failure=True)

    async def _publish_rejected(self, item: WorkItem, code: str) -> None:
        usage = usage_of(item, FinishReason.REJECTED, status=UsageStatus.REJECTED, error_code=code)
        await self._publish(self._topics.usage, item.tenant_id.encode(), encode(usage))

    async def _reply_only(
        self,
        reply_to: str,
        tenant_id: str,
        request_id: str,
        seq: int | range,
        error: ErrorInfo,
    ) -> None:
        """One refusal chunk (a chunk a seq, in one record, for a ``range``) and nothing
        else: no UsageEvent, no ledger entry."""
        chunks = [
            TokenChunk(
                request_id=request_id,
                tenant_id=tenant_id,
                seq=n,
                finish_reason=FinishReason.REJECTED,
                error=error,
            )
            for n in (range(seq, seq + 1) if isinstance(seq, int) else seq)
        ]
        if chunks:
            batch = TokenChunkBatch(tenant_id=tenant_id, chunks=chunks)
            await self._publish(reply_to, reply_batch_key(tenant_id), encode(batch))

    async def _answer_duplicate(self, item: WorkItem, seq: int, finished: bool) -> None:
        """A repeat of a request that ran: one chunk, after the stream it repeats (so no
        seq is repeated), and no UsageEvent (the run has its one)."""
        error = _duplicate(item.tenant_id, item.request_id, finished)
        await self._reply_only(item.reply_to, item.tenant_id, item.request_id, seq, error)

    async def _answer_copies(
        self, reply_to: str, tenant_id: str, request_id: str, owed: range
    ) -> None:
        """The answers owed to the copies taken while the request ran, after its own: one
        record (at most ``MAX_COPIES`` chunks)."""
        error = _duplicate(tenant_id, request_id, True)
        await self._reply_only(reply_to, tenant_id, request_id, owed, error)

    # -- observations (usage runs in the tenant's agent; the rest anywhere) ----------------
    def note_lag(self, stream: str, since: float) -> None:
        """Samples the lag of one input (``since``: epoch seconds) for the metrics."""
        samples = self.metrics.lag_ms.setdefault(stream, [])
        samples.append(max(0.0, self._clock.time() - since) * 1000)
        del samples[:-1000]

    def load_reports(self, instance: str) -> list[LoadReport]:
        """A ``LoadReport`` per model this instance sees (live workers, requests waiting
        or in flight), over the interval since the last call; the app publishes them."""
        now = self._clock.monotonic()
        interval_s, self._load_since = now - self._load_since, now
        samples = self._load.take()
        waiting: dict[str, list[int]] = {}
        for entry in self._waiting.values():
            waiting.setdefault(entry.request.model, [0, 0, 0])[entry.request.priority] += 1
        workers = self._registry.all_live(now)
        models = (
            {view.status.model for view in workers} | set(waiting) | set(self._in_flight.models())
        )
        return [
            load_report(
                model,
                instance=instance,
                interval_s=interval_s,
                samples=samples.get(model),
                waiting_by_class=waiting.get(model, [0, 0, 0]),
                workers=[view.status for view in workers if view.status.model == model],
                num_in_flight=self._in_flight.of_model(model).num,
                num_batch_in_flight=self._in_flight.of_model(model).num_batch_lines,
            )
            for model in sorted(models)
        ]

    def observe_usage(self, value: bytes | None) -> None:
        """Settles the window on the real count, frees the slot, corrects the VTC counter."""
        try:
            usage = decode(UsageEvent, value)
        except SchemaError:
            return  # the billing sink dead-letters usage it cannot read
        self.note_lag("usage_since_finish", usage.finished_at.timestamp())
        self._load.note_usage(usage.model, usage.priority, usage.ttft_ms)
        window = window_key(usage.tenant_id, usage.batch_id)
        state = self._store.load(window)
        weight = cost_weight(
            usage.num_prompt_tokens, usage.precision, usage.created_at, self._peak_hours
        )
        actual = math.ceil((usage.num_prompt_tokens + usage.num_completion_tokens) * weight)
        settle(state, usage.request_id, actual, self._clock.time())
        reserved = self._reserved(window, usage.request_id)  # settled: kept in its entry
        self._settle_budgets(usage)
        ident = (usage.tenant_id, usage.request_id)
        if usage.status is not UsageStatus.REJECTED:
            # It ran (or was cancelled): the same id produced again is a duplicate. (The
            # job marks its own refusals itself: a refusal of a producer it could not
            # identify must not mark the id of the tenant that producer named.)
            entry = self._ledger.get(*ident)
            done, owed = ended(
                entry,
                Entry(
                    State.DONE,
                    entry.reply_to if entry else "",
                    self._clock.time() + self._settings.request_dedupe_s,
                    usage.last_seq or 0,
                    reserved=reserved,
                ),
            )
            self._ledger.put(*ident, done)
            if owed:
                # The turn is taken now, as the seqs are given (stream_jobs.answer_order).
                self._owed.append((done.reply_to, *ident, owed, self._answer_order.take(ident)))
        if usage.status is not UsageStatus.REJECTED:
            self._supersede(ident, usage.attempt)
        flight = self._in_flight.get(ident)
        if flight is not None and flight.request.attempt == usage.attempt:
            del self._in_flight[ident]
            self._queue.correct(
                flight.request.tenant_id,
                flight.request.priority,
                estimated_output=flight.request.sampling.max_tokens,
                actual_output=usage.num_completion_tokens,
            )
            # At once, not at the dispatch loop's next turn: several usage events read
            # together would otherwise skip a tier on the way down.
            self._update_tier()
            self._wake.set()

    def observe_heartbeat(self, value: bytes | None) -> None:
        try:
            status = decode(WorkerStatus, value)
        except SchemaError as exc:
            log.warning("ignoring a malformed heartbeat: %s", exc)
            return
        own_topic = self._topics.worker(status.worker_id)
        if status.request_topic != own_topic:
            # The job forwards prompts to the topic a heartbeat names: only the worker's
            # own, named after it, never one a tenant can read (a reply topic, say).
            log.warning(
                "ignoring a heartbeat of worker %r naming %r, not its topic %r",
                status.worker_id,
                status.request_topic,
                own_topic,
            )
            return
        self.note_lag("heartbeats", status.sent_at.timestamp())
        # Judged on arrival (the monotonic reading), never by comparing the worker's wall
        # stamp with the job's: hosts' clocks differ, and a job whose wall reading is
        # moved (the tests' offset) would find every worker dead. Old heartbeats are
        # never read: the heartbeat consumer starts at the end of the topic.
        now = self._clock.monotonic()
        self._registry.observe(status, now)
        self.metrics.workers = {
            view.status.worker_id: view.status for view in self._registry.all_live(now)
        }
        self._wake.set()

    async def handle_cancel(self, record: Record) -> None:
        """A producer's cancel, checked like its requests: its credential must be the
        tenant's, and ``reassigned`` is the job's own word. A good one drops the request
        if it waits here, and goes on to the workers on the aborts topic, which only
        tokenbus's services write; a bad one goes to the dead-letter topic."""
        try:
            cancel = decode(CancelRequest, record.value)
            principal = self._auth.authenticate(header(record.headers, "authorization"))
        except (SchemaError, AuthError) as exc:
            await self._dead_letter(record, f"cancel refused: {exc}")
            return
        if cancel.tenant_id != principal.tenant_id or cancel.reason == REASSIGNED:
            await self._dead_letter(
                record,
                f"cancel refused: the credential is tenant {principal.tenant_id!r}'s, and "
                f"may cancel only its own requests, with any reason but {REASSIGNED!r}",
            )
            return
        ident = (cancel.tenant_id, cancel.request_id)
        waiting = self._waiting.pop(ident, None)
        if waiting is None:
            flight = self._in_flight.get(ident)
            if flight is not None:
                flight.cancelled = True  # its worker aborts it; if that worker is lost, so do we
            # Running (or held by an earlier run of this job): its worker aborts it.
            await self._publish(self._topics.aborts, cancel.tenant_id.encode(), encode(cancel))
            return
        self._queue.remove(_queue_key(ident))
        try:
            await self._answer(
                waiting.request,
                FinishReason.ABORT,
                UsageStatus.CANCELLED,
                ErrorInfo(code="cancelled", message=cancel.reason),
            )
        except Exception:
            # Not answered: it waits again, as it was, rather than be neither served nor
            # told. The cancel is logged by its agent; the producer may send it again.
            if not waiting.done.done():
                self._waiting[ident] = waiting
                self._queue_again(waiting)
            raise
        self.metrics.num_cancelled_waiting += 1
        if not waiting.done.done():
            waiting.done.set_result(Outcome.CANCELLED)
        self._update_tier()

    def waiting_counts(self) -> dict[tuple[str, int], int]:
        """Requests waiting in this instance's queue, by (model, class): for the metrics,
        at scrape time (the queue is not walked on the hot path)."""
        counts: dict[tuple[str, int], int] = {}
        for waiting in list(self._waiting.values()):
            key = (waiting.request.model, waiting.request.priority)
            counts[key] = counts.get(key, 0) + 1
        return counts

    # -- the dispatch loop ------------------------------------------------------------------
    async def run(self) -> None:
        """Forwards waiting requests while the fleet has room; wakes on every change."""
        while True:
            try:
                # Not wait_for: on Python 3.11 it can swallow a cancel that comes as the
                # event is set, and the loop would never stop.
                async with asyncio.timeout(0.05):
                    await self._wake.wait()
            except TimeoutError:
                pass  # a periodic look: workers may have died or come back
            self._wake.clear()
            try:
                self._turn()
            except Exception:
                # A bug in one turn must not end the loop: every later request would
                # wait for good, and nothing would say why.
                log.exception("a turn of the dispatch loop failed; the loop goes on")

    def _turn(self) -> None:
        """One look: reaps lost workers, forwards what has room, updates the tier, and
        says so when requests wait while nothing has been forwarded for a while."""
        now = self._clock.monotonic()
        for run in self._registry.reap(now):
            self._recover_from(run)
        if self._orphans:
            self._watch_orphans(now)
        while (priority := self._queue.peek_priority()) is not None:
            if not self._has_room(priority):
                break
            waiting = self._queue.pop(priority)
            assert waiting is not None
            self._waiting.pop((waiting.request.tenant_id, waiting.request.request_id), None)
            # Picked and counted in flight now; the broker's ack is awaited in a task of
            # its own, so the next pick (a class 0 request, say) does not wait one
            # produce round trip per request picked before it.
            task = asyncio.create_task(self._forward(waiting, self._pick(waiting)))
            self._forwarding.add(task)
            task.add_done_callback(self._forwarding.discard)
            self._last_forward_at = now
        self._update_tier()
        if not self._waiting:
            self._last_forward_at = now
        elif now - max(self._last_forward_at, self._stall_said_at) >= STALL_WARN_S:
            self._stall_said_at = now
            log.warning(
                "%d requests wait and none was forwarded for %.0f s: %d in flight, "
                "%d seats live, %d forwards pending, models live: %s",
                len(self._waiting),
                now - self._last_forward_at,
                len(self._in_flight),
                self._capacity(),
                len(self._forwarding),
                sorted(self._registry.models(now)) or "none",
            )

    async def _forward(self, waiting: _Waiting, picked: _Picked | None) -> None:
        try:
            try:
                outcome = await self._send(waiting, picked)
            except MessageSizeTooLargeError as exc:
                # Never fits, however often it is sent (a resumed request carries the
                # tokens it streamed): answered, not retried for good with its event
                # unacked. (Should the answer fail, it is retried below, and refused again.)
                outcome = await self._refuse_too_large(waiting, exc)
        except Exception:
            # Not forwarded (nor answered): the broker refused the send or timed out.
            # It waits for a seat again, its event still unacked, rather than be acked
            # as a failure and lost; should the job stop meanwhile, the event is
            # redelivered to the next instance.
            self.metrics.num_forward_retries += 1
            request = waiting.request
            log.warning(
                "forwarding %s/%s failed; it waits again",
                request.tenant_id,
                request.request_id,
                exc_info=True,
            )
            await asyncio.sleep(FORWARD_RETRY_S)
            if not waiting.done.done():  # its agent may have been cancelled meanwhile
                self._queue_again(waiting)
        else:
            if not waiting.done.done():
                waiting.done.set_result(outcome)

    async def _refuse_too_large(self, waiting: _Waiting, exc: Exception) -> Outcome:
        request = waiting.request
        self.metrics.num_rejected_invalid += 1
        log.warning("%s/%s cannot be forwarded: %s", request.tenant_id, request.request_id, exc)
        error = ErrorInfo(
            code="request_too_large",
            message="the request, as forwarded to its worker, is larger than a record "
            "may be; send a shorter prompt or fewer stop strings",
        )
        return await self._turn_down(request, error, self._clock.time(), home=waiting.home)

    def _capacity(self) -> int:
        return self._registry.capacity(self._clock.monotonic())

    def _has_room(self, priority: int) -> bool:
        """Whether the head of class ``priority`` may be forwarded: a seat for its class
        (``seats``), and for class 2 room under its model's batch yield cap."""
        now = self._clock.monotonic()
        num_in_flight, capacity = len(self._in_flight), self._capacity()

        def seat(num_yielding: int = 0) -> bool:
            return has_room(
                priority,
                num_in_flight,
                capacity,
                self._settings.vip_reserve,
                since_start_s=now - self._started_at,
                learn_fleet_s=self._settings.worker_dead_after_s,
                num_yielding=num_yielding,
            )

        if seat():
            if priority < BATCH_CLASS:
                return True
            num_batch, cap = self._batch_cap(priority, now)
            return cap is None or num_batch < cap
        if priority == BATCH_CLASS or capacity == 0:
            return False
        # No seat by the count: do batch lines above the yield cap hold some? (Looked at
        # only here, so the common case walks nothing.)
        num_batch, cap = self._batch_cap(priority, now)
        return seat(num_yielding(num_batch, cap))

    def _batch_cap(self, priority: int, now: float) -> tuple[int, int | None]:
        """For the model of the head of class ``priority``: its class 2 requests in
        flight, and the batch yield's cap on them (None: none now)."""
        head = self._queue.peek(priority)
        if head is None:
            return 0, None
        model = head.request.model
        counts = self._in_flight.of_model(model)
        num_batch, num_interactive = counts.num_batch_class, counts.num - counts.num_batch_class
        cap = self._batch_yield.batch_cap(
            model,
            now,
            num_workers=len(self._registry.live(model, now)),
            num_interactive_in_flight=num_interactive,
        )
        return num_batch, cap

    async def _dispatch(self, waiting: _Waiting) -> Outcome:
        return await self._send(waiting, self._pick(waiting))

    async def _send(self, waiting: _Waiting, picked: _Picked | None) -> Outcome:
        """Forwards a picked request, or answers no_worker when nothing could be picked."""
        if picked is None:
            self.metrics.num_no_worker += 1
            live = sorted(self._registry.models(self._clock.monotonic()))
            return await self._turn_down(
                waiting.request,
                ErrorInfo(
                    code="no_worker",
                    message=f"no live worker serves model {waiting.request.requested_model!r}"
                    f" (served now: {', '.join(live) or 'none'})",
                    retry_after_s=1.0,
                ),
                self._clock.time(),
                home=waiting.home,
            )
        forwarded, topic = picked
        # Admitted (or sent again) to forwarded: the fair queue's wait, the route, the
        # send. The worker's spans are its children.
        queued = start_span(
            self._tracer,
            "job.queue",
            context=waiting.trace,
            start_time=waiting.queued_ns,
            kind=SpanKind.PRODUCER,
            attributes=span_attributes(
                tenant=forwarded.tenant_id,
                request_id=forwarded.request_id,
                attempt=forwarded.attempt,
                priority=forwarded.priority,
                worker=forwarded.worker_id,
            ),
        )
        flight = self._in_flight.get((forwarded.tenant_id, forwarded.request_id))
        if flight is not None:
            flight.trace = waiting.trace
        # The path goes on from the send: the acknowledgement's wait is the bus's.
        sent_ns = max(waiting.queued_ns, self._wall_ns())
        headers: list[tuple[str, bytes]] = []
        inject(headers, with_path(sent_ns, set_span_in_context(queued)))
        try:
            sent = await self._publish(
                topic, forwarded.tenant_id.encode(), encode(forwarded), headers
            )
        except Exception:
            self._in_flight.pop((forwarded.tenant_id, forwarded.request_id), None)
            queued.set_status(StatusCode.ERROR, "not forwarded")
            queued.end()
            raise
        queued.end(end_time=sent_ns)
        self._note_forward(forwarded, waiting.home, sent)
        self.metrics.num_dispatched += 1
        return Outcome.FORWARDED

    def _note_forward(self, forwarded: WorkItem, home: int | None, sent: Any) -> None:
        """FORWARDED in the ledger, with where it runs (the record's place, from the
        broker's acknowledgement), before its event may be acked: so a job started later
        adopts it. Written to the tenant's partition, as this runs outside its event."""
        offset = getattr(sent, "offset", None)
        forward = (
            Forward(home, sent.topic, sent.partition, offset)
            if home is not None and isinstance(offset, int)
            else None
        )
        self._remember(forwarded, State.FORWARDED, self._clock.time(), home=home, forward=forward)
        flight = self._in_flight.get((forwarded.tenant_id, forwarded.request_id))
        if flight is not None and flight.request is forwarded:
            flight.forwarded = True

    def _pick(self, waiting: _Waiting) -> _Picked | None:
        """Chooses the worker and counts the request in flight there, without awaiting,
        so that ``_has_room`` and the routing of the next pick already see it. Returns
        the copy to forward and the worker's topic (the worker may be gone by the send)."""
        request = waiting.request
        now = self._clock.monotonic()
        session = (request.tenant_id, request.session_id)
        previous = self._affinity.previous(session)
        candidates = [view.candidate() for view in self._registry.live(request.model, now)]
        adapter = request.adapter.name if request.adapter else None
        chosen = choose_for_adapter(
            candidates, request.priority, self._routing, adapter=adapter, previous=previous
        )
        worker = self._registry.get(chosen.worker_id) if chosen is not None else None
        if chosen is None or worker is None:
            return None
        if previous == worker.status.worker_id:
            self.metrics.num_affine += 1
        if adapter is not None and adapter in chosen.adapters:
            self.metrics.num_adapter_affine += 1
        forwarded = request.model_copy(
            update={
                "worker_id": worker.status.worker_id,
                "worker_incarnation": worker.status.incarnation,
                "dispatched_at": datetime.fromtimestamp(self._clock.time(), UTC),
            }
        )
        self._in_flight[(request.tenant_id, request.request_id)] = _InFlight(
            forwarded, home=waiting.home
        )
        self._registry.note_dispatch(worker.status.worker_id, adapter, now)
        self._affinity.note(session, worker.status.worker_id)
        samples = self.metrics.queue_ms_by_class[request.priority]
        samples.append((now - waiting.received_at) * 1000)
        del samples[:-1000]
        self._load.note_queue_wait(request.model, request.priority, samples[-1])
        return forwarded, worker.status.request_topic

    # -- failover -------------------------------------------------------------------------
    def _recover_from(self, run: tuple[str, str]) -> None:
        """A worker run is gone: each request it held is finished or sent elsewhere."""
        lost = [flight for flight in self._in_flight.values() if flight.worker == run]
        self.metrics.num_workers_lost += 1
        log.warning("worker %s (run %s) is gone with %d requests", run[0], run[1], len(lost))
        self._affinity.forget_worker(run[0])
        for flight in lost:
            self._start_recovery(flight)

    def _start_recovery(self, flight: _InFlight) -> None:
        self._orphans.pop((flight.request.tenant_id, flight.request.request_id), None)
        task = asyncio.create_task(self._recover(flight))
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    # -- adoption -------------------------------------------------------------------------
    async def take_partitions(self, homes: set[int]) -> int:
        """This instance now holds partitions ``homes`` of the request topics (after a
        start or a rebalance, once their tables are recovered). Requests in flight for
        other partitions are forgotten: their new holder adopts them, and their usage
        no longer comes here. Requests forwarded for ``homes`` that this instance does
        not hold are adopted (``adopt``). Returns how many were adopted."""
        given_away = [
            ident
            for ident, flight in self._in_flight.items()
            if flight.home is not None and flight.home not in homes
        ]
        for ident in given_away:
            del self._in_flight[ident]
            self._orphans.pop(ident, None)
        if given_away:
            log.info("%d requests in flight are another instance's now", len(given_away))
            self._update_tier()
            self._wake.set()
        return await self.adopt(homes)

    async def adopt(self, homes: set[int]) -> int:
        """Takes over the requests the ledger says were forwarded for partitions
        ``homes``, and that this instance does not hold: those of an earlier run of the
        job, or of the instance that held these partitions. Each is read back from its
        worker's topic and is in flight here again, on the run it was sent to. A run not
        seen live within ``worker_dead_after_s`` of the adoption is gone, and its
        requests are sent again as after any worker loss (``_watch_orphans``)."""
        if self._forwards is None:
            return 0
        found = [
            (ident, entry.forward)
            for tenant, request_id, entry in self._ledger.forwarded(homes, self._clock.time())
            if entry.forward is not None and not self._holds(ident := (tenant, request_id))
        ]
        if not found:
            return 0
        values = await self._forwards.read([fw.place for _, fw in found])
        since = self._clock.monotonic()
        num_adopted = 0
        for ident, forward in found:
            entry = self._ledger.get(*ident)
            if (
                entry is None
                or entry.state is not State.FORWARDED
                or entry.forward != forward
                or self._holds(ident)
            ):
                continue  # it finished, or was sent again, while the records were read
            item = _forwarded_copy(values.get(forward.place), ident)
            if item is None:
                self.metrics.num_adoptions_failed += 1
                log.error(
                    "cannot adopt %s/%s: %s[%d] holds no forwarded copy of it at offset %d",
                    *ident, forward.topic, forward.partition, forward.offset,
                )  # fmt: skip
                continue
            self._in_flight[ident] = _InFlight(item, home=forward.home, forwarded=True)
            self._orphans[ident] = since
            num_adopted += 1
        self.metrics.num_adopted += num_adopted
        if num_adopted:
            log.info("adopted %d requests in flight for partitions %s", num_adopted, sorted(homes))
            self._update_tier()
            self._wake.set()
        return num_adopted

    def _watch_orphans(self, now: float) -> None:
        """Each adopted request whose worker run is seen live is the registry's to
        watch from then on; one whose run is not seen within ``worker_dead_after_s`` of
        its adoption is on a run that is gone (it died while nobody held the request)."""
        for ident, since in list(self._orphans.items()):
            flight = self._in_flight.get(ident)
            if flight is None:
                del self._orphans[ident]
                continue
            worker_id, incarnation = flight.worker
            view = self._registry.get(worker_id) if worker_id is not None else None
            if view is not None and view.key == (worker_id, incarnation):
                del self._orphans[ident]
            elif now - since >= self._settings.worker_dead_after_s:
                log.warning(
                    "adopted %s/%s: its worker %s (run %s) is gone", *ident, worker_id, incarnation
                )
                self._start_recovery(flight)

    async def _recover(self, flight: _InFlight) -> None:
        request = flight.request
        # Should the run be only presumed dead (paused, cut off), it drops this attempt
        # on reading this, rather than go on streaming beside the next one.
        reassigned = CancelRequest(
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            reason=REASSIGNED,
            attempt=request.attempt,
        )
        try:
            key = request.tenant_id.encode()
            await self._publish(self._topics.aborts, key, encode(reassigned))
        except Exception:
            log.exception("could not tell %s's old worker to drop it", request.request_id)
        try:
            chunks = await self._replies.read(
                reply_to=request.reply_to,
                tenant_id=request.tenant_id,
                request_id=request.request_id,
                since=request.admitted_at,
            )
            progress = delivered(chunks, request.request_id, request.tenant_id)
        except Exception:
            log.exception("could not read the replies of %s; it starts again", request.request_id)
            progress = Delivered()
        ident = (request.tenant_id, request.request_id)
        if self._in_flight.get(ident) is not flight:
            return  # its UsageEvent arrived meanwhile: the worker had finished it
        del self._in_flight[ident]
        if progress.last is not None:
            # It had finished, but its UsageEvent was lost with the worker: write it.
            self.metrics.num_recovered_finished += 1
            await self._publish_usage(request, progress)
            self._wake.set()
            return
        again = resume(request, progress)
        if flight.cancelled:
            await self._answer(
                again,
                FinishReason.ABORT,
                UsageStatus.CANCELLED,
                ErrorInfo(code="cancelled", message="cancelled by the client"),
            )
            return
        self.metrics.num_redispatched += 1
        if progress.next_seq:
            self.metrics.num_resumed += 1
        log.info(
            "sending %s again (attempt %d) after %d chunks, %d tokens",
            request.request_id,
            again.attempt,
            progress.next_seq,
            len(progress.token_ids),
        )
        waiting = self._new_waiting(again, flight.trace, home=flight.home)
        if again.priority == BATCH_CLASS and not self._capacity():
            # A batch line with no live worker left waits in the queue for one, and its
            # stream resumes there (one stream, billed once), rather than fail.
            self._requeue(waiting)
            return
        try:
            # Answered no_worker, it is marked done (``_send``): a later job must not
            # adopt and run it.
            await self._dispatch(waiting)
        except Exception:
            log.exception("could not send %s again", request.request_id)
            self._in_flight.pop(ident, None)
            await self._answer(
                again,
                FinishReason.ERROR,
                UsageStatus.FAILED,
                ErrorInfo(code="worker_lost", message="its worker was lost; resending failed"),
            )
        self._wake.set()

    def _new_waiting(
        self, request: WorkItem, trace: Context | None = None, *, home: int | None
    ) -> _Waiting:
        """A request about to be queued, stamped on both readings of the clock."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        queued_ns = self._wall_ns()
        return _Waiting(request, future, self._clock.monotonic(), queued_ns, trace, home)

    def _wall_ns(self) -> int:
        return round(self._clock.time() * 1e9)

    def _requeue(self, waiting: _Waiting) -> None:
        """A request sent again after a worker loss, back in the fair queue."""
        waiting.done.add_done_callback(_retrieved)  # nobody awaits a resent request
        self._queue_again(waiting)

    def _queue_again(self, waiting: _Waiting) -> None:
        """Back in the fair queue, at its class and its tenant's weight: charged at its
        first admission, its prompt's cost in the queue is left out."""
        request = waiting.request
        self._enqueue(waiting, request.priority, self._tenants.get(request.tenant_id).weight, 0)

    def _enqueue(self, waiting: _Waiting, priority: int, weight: float, num_input: int) -> None:
        """Into the fair queue, to be forwarded when its class has a seat."""
        request = waiting.request
        ident = (request.tenant_id, request.request_id)
        self._waiting[ident] = waiting
        if priority < BATCH_CLASS:
            # Before the next turn: the request that starts a burst already finds class 2
            # held to its cap, rather than a load report later.
            self._batch_yield.note_interactive(request.model, self._clock.monotonic())
        self._queue.push(
            _queue_key(ident),
            waiting,
            tenant=request.tenant_id,
            priority=priority,
            weight=weight,
            num_input=num_input,
            num_output=request.sampling.max_tokens,
            filler=request.batch_id is not None,
        )
        self._wake.set()

    async def _publish_usage(self, request: WorkItem, progress: Delivered) -> None:
        last = progress.last
        assert last is not None and last.finish_reason is not None
        usage = usage_of(
            request,
            last.finish_reason,
            worker_id=request.worker_id,
            num_prompt_tokens=last.num_prompt_tokens or 0,
            num_completion_tokens=len(progress.token_ids),
            error_code=last.error.code if last.error else None,
            flags=[*request.flags, "usage_from_replies"],
            last_seq=progress.next_seq - 1,
        )
        await self._publish(self._topics.usage, request.tenant_id.encode(), encode(usage))

    async def _shed(
        self, item: WorkItem, message: str, now: float, tier: Tier = Tier.NORMAL
    ) -> Outcome:
        """Turns a class 2 request down ``overloaded``, to come again in a second."""
        self.metrics.num_shed += 1
        error = ErrorInfo(code="overloaded", message=message, retry_after_s=1.0)
        return await self._turn_down(item, error, now, tier=tier)

    def _update_tier(self, extra_waiting: int = 0) -> None:
        """The overload tier for the demand now. A batch job's lines are not in it: they
        fill idle seats, their runner paces them, and they yield to class 0/1
        (``tokenbus.batch_yield``). Counted, a batch running alone held the demand at the
        cap's threshold, and the job went between tier 0 and 1 several times a second,
        each time capping the ``max_tokens`` of the interactive requests it admitted."""
        capacity = self._capacity()
        num_waiting = len(self._queue) - self._queue.num_filler + extra_waiting
        num_busy = len(self._in_flight)
        demand = demand_ratio(num_busy, num_waiting, capacity)
        if demand is not None and demand > self._tiers.cap_above - self._tiers.release_margin:
            # Near a threshold: without the batch lines in flight either. (Below it, the
            # tier is normal with or without them, and this pass is not needed.)
            num_busy -= self._in_flight.num_batch_lines
            demand = demand_ratio(num_busy, num_waiting, capacity)
        tier = self._tiers.next_tier(self._tier, demand)
        self.metrics.num_waiting = len(self._queue)
        self.metrics.num_in_flight = len(self._in_flight)
        self.metrics.capacity = capacity
        if tier is not self._tier:
            shown = "unknown" if demand is None else f"{demand:.0%}"
            log.warning("overload tier %d -> %d at demand %s", self._tier, tier, shown)
            self._tier = tier
            self.metrics.tier = int(tier)
            self.metrics.num_tier_changes += 1
            self.metrics.tier_changed_at = self._clock.time()

    # -- answers ------------------------------------------------------------------------------
    async def _refuse(self, request: WorkItem, error: ErrorInfo, tier: Tier = Tier.NORMAL) -> None:
        await self._answer(
            request.model_copy(update={"overload_tier": int(tier)}),
            FinishReason.REJECTED,
            UsageStatus.REJECTED,
            error,
        )

    async def _answer(
        self, request: WorkItem, finish: FinishReason, status: UsageStatus, error: ErrorInfo
    ) -> None:
        """Tells the client at once, and records the request for billing.

        A request resumed after a worker loss has already streamed some tokens: the
        answer continues its stream, and those tokens are billed as failed work."""
        if request.resume_seq and status is UsageStatus.REJECTED:
            status = UsageStatus.FAILED
        chunk = TokenChunk(
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            seq=request.resume_seq,
            finish_reason=finish,
            error=error,
        )
        usage = usage_of(
            request,
            finish,
            status=status,
            num_completion_tokens=len(request.resume_token_ids),
            error_code=error.code,
            last_seq=request.resume_seq,
        )
        batch = TokenChunkBatch(tenant_id=request.tenant_id, chunks=[chunk])
        await asyncio.gather(
            self._publish(request.reply_to, reply_batch_key(request.tenant_id), encode(batch)),
            self._publish(self._topics.usage, request.tenant_id.encode(), encode(usage)),
        )


def _duplicate(tenant_id: str, request_id: str, finished: bool) -> ErrorInfo:
    """``finished``: the request has had its answer (its stream, or a refusal), earlier
    on this reply topic; otherwise it runs now, for another reply topic."""
    where = (
        "has had its answer, earlier on this reply topic"
        if finished
        else "is running, for another reply topic"
    )
    return ErrorInfo(
        code="duplicate_request",
        message=f"request {request_id!r} of tenant {tenant_id!r} {where}; an id runs "
        "once (send a retry under a new id)",
    )


def _forwarded_copy(value: bytes | None, ident: Key) -> WorkItem | None:
    """The WorkItem a worker topic's record holds, if it is the one of ``ident``."""
    if value is None:
        return None
    try:
        item = decode(WorkItem, value)
    except SchemaError:
        return None
    return item if (item.tenant_id, item.request_id) == ident else None


def _retrieved(done: asyncio.Future[Outcome]) -> None:
    if not done.cancelled():
        done.exception()  # read, so an error a resent request met is not reported unread


def _queue_key(ident: Key) -> str:
    return f"{ident[0]}/{ident[1]}"
