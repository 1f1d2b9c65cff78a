"""Admission and dispatch: the thin shell around the job's policies.

# raw request --> InferenceRequest --> tenant rules --> overload tier --> TPM/RPM window
# admitted request --> FairQueue (class, then VTC share) --> routing.choose --> worker topic
# a worker run lost (registry.reap) --> its requests: usage written, or sent again resumed
# UsageEvent --> settle the window, free the slot, correct the tenant's VTC counter
# CancelRequest --> drop the request if it is still waiting

Delivery: ``handle_request`` returns only once its request has been forwarded to a
worker (acknowledged by the broker), answered with a chunk on its reply topic (a
TokenChunkBatch of one), or dead-lettered. The Faust agent acks the event after that,
and Faust commits only acked offsets, so a crash redelivers rather than loses. A
redelivered request is not charged twice: its reservation is already in the window.

State: the windows live in a ``WindowStore`` (a changelog-backed Faust table in the job),
written only from the agent handling the tenant's partition. The queue, the in-flight
set, session affinity and the tier are this instance's own, rebuilt from redeliveries
and heartbeats. (The in-flight set is what failover resends from: a job restarted while
a worker dies loses that worker's running requests; clients see a timeout.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Protocol

from schemas import (
    REASSIGNED,
    CancelRequest,
    ErrorInfo,
    FinishReason,
    InferenceRequest,
    SchemaError,
    TokenChunk,
    TokenChunkBatch,
    UsageEvent,
    UsageStatus,
    WorkerStatus,
    decode,
    encode,
)
from stream_jobs.fair_queue import FairQueue
from stream_jobs.prompt_tokens import PromptCounter
from stream_jobs.recovery import Delivered, delivered, resume
from stream_jobs.registry import WorkerRegistry
from stream_jobs.routing import RoutingWeights, choose
from stream_jobs.tiers import Tier, TierPolicy, apply_tier, demand_ratio
from stream_jobs.window import Limits, WindowState, release, reserve, settle
from tokenbus.config import Settings
from tokenbus.cost import PeakHours, cost_weight
from tokenbus.dlq import dead_letter
from tokenbus.kafka import Publish
from tokenbus.tenants import TenantDirectory
from tokenbus.topics import Topics, reply_batch_key
from tokenbus.usage import usage_of

log = logging.getLogger(__name__)


class WindowStore(Protocol):
    """Per-tenant quota windows. ``save`` is called from the tenant's partition's agent."""

    def load(self, tenant_id: str) -> WindowState: ...

    def save(self, tenant_id: str, state: WindowState) -> None: ...


class MemoryWindowStore:
    def __init__(self) -> None:
        self._states: dict[str, WindowState] = {}

    def load(self, tenant_id: str) -> WindowState:
        return self._states.get(tenant_id) or WindowState()

    def save(self, tenant_id: str, state: WindowState) -> None:
        self._states[tenant_id] = state


class ReplyLog(Protocol):
    """Reads back the chunks a request's reply topic holds (see ``tokenbus.replies``)."""

    def read(self, request: InferenceRequest) -> Awaitable[list[TokenChunk]]: ...


class Outcome(Enum):
    FORWARDED = "forwarded"
    REFUSED = "refused"
    CANCELLED = "cancelled"
    DUPLICATE = "duplicate"
    """A redelivered request that already ran to completion: nothing to do."""


@dataclass
class _Waiting:
    request: InferenceRequest
    done: asyncio.Future[Outcome]
    received_at: float


_Picked = tuple[InferenceRequest, str]
"""A request as forwarded to its worker, and that worker's topic."""


@dataclass
class _InFlight:
    request: InferenceRequest
    """The copy forwarded to the worker."""
    cancelled: bool = False

    @property
    def worker(self) -> tuple[str | None, str | None]:
        return (self.request.worker_id, self.request.worker_incarnation)


@dataclass
class DispatchMetrics:
    num_admitted: int = 0
    num_rejected_quota: int = 0
    num_rejected_invalid: int = 0
    num_shed: int = 0
    num_capped: int = 0
    num_no_worker: int = 0
    num_cancelled_waiting: int = 0
    num_dead_letters: int = 0
    num_dispatched: int = 0
    num_duplicates: int = 0
    num_tier_changes: int = 0
    num_workers_lost: int = 0
    num_redispatched: int = 0
    num_resumed: int = 0
    num_recovered_finished: int = 0
    num_affine: int = 0
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


class Dispatcher:
    """Admits requests and forwards them by class and fair share as capacity frees up."""

    def __init__(
        self,
        settings: Settings,
        publish: Publish,
        store: WindowStore,
        replies: ReplyLog,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._publish = publish
        self._store = store
        self._replies = replies
        self._clock = clock
        self._topics = Topics(settings.topic_prefix)
        self._tenants: TenantDirectory = settings.tenant_directory()
        self._counter = PromptCounter(settings.model_dir / "tokenizer.json")
        self._registry = WorkerRegistry(dead_after_s=settings.worker_dead_after_s)
        self._queue: FairQueue[_Waiting] = FairQueue()
        self._waiting: dict[str, _Waiting] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._routing = RoutingWeights(
            kv=settings.route_weight_kv,
            queue=settings.route_weight_queue,
            load=settings.route_weight_load,
            kv_threshold=settings.route_kv_threshold,
            priority_bonus=settings.route_priority_bonus,
            affinity_margin=settings.affinity_margin,
        )
        # (tenant, session) -> the worker that served the session's last turn.
        self._affinity: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._recoveries: set[asyncio.Task[None]] = set()
        self._forwarding: set[asyncio.Task[None]] = set()
        self._tiers = TierPolicy(
            cap_above=settings.tier_cap_above,
            shed_above=settings.tier_shed_above,
            capped_max_tokens=settings.tier_capped_max_tokens,
        )
        self._tier = Tier.NORMAL
        self._peak_hours = PeakHours.parse(settings.peak_hours, settings.peak_hours_tz)
        self._wake = asyncio.Event()
        self._started_at = time.monotonic()
        self.metrics = DispatchMetrics()

    # -- admission (runs in the request's agent: may write the tenant's window) --------
    async def handle_request(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None
    ) -> Outcome:
        try:
            request = decode(InferenceRequest, value)
        except SchemaError as exc:
            self.metrics.num_dead_letters += 1
            await dead_letter(
                self._publish,
                self._topics,
                consumer=self._settings.faust_app_id,
                source_topic=topic,
                partition=partition,
                offset=offset,
                key=key,
                value=value,
                reason=str(exc),
            )
            return Outcome.REFUSED

        tenant = self._tenants.get(request.tenant_id)
        num_prompt = self._counter.count(request)
        problem = self._check_tenant_rules(request, num_prompt)
        if problem is not None:
            self.metrics.num_rejected_invalid += 1
            await self._refuse(request, problem)
            return Outcome.REFUSED

        # A tenant cannot buy a better class than its config gives it.
        priority = max(request.priority, tenant.priority_class)
        self._update_tier(extra_waiting=1)
        action = apply_tier(self._tiers, self._tier, priority, request.sampling.max_tokens)
        if action.shed:
            self.metrics.num_shed += 1
            await self._refuse(
                request,
                ErrorInfo(
                    code="overloaded",
                    message=f"the fleet is above {self._tiers.shed_above:.0%} of capacity; "
                    "batch requests are shed until it recovers",
                    retry_after_s=1.0,
                ),
                tier=self._tier,
            )
            return Outcome.REFUSED
        updates: dict[str, object] = {"priority": priority, "overload_tier": int(self._tier)}
        if action.max_tokens is not None:
            self.metrics.num_capped += 1
            updates["sampling"] = request.sampling.model_copy(
                update={"max_tokens": action.max_tokens}
            )
            updates["flags"] = [*request.flags, "max_tokens_capped"]
        if tenant.sharing_group is not None:
            updates["cache_salt"] = f"group:{tenant.sharing_group}"
        request = request.model_copy(update=updates)

        now = self._clock()
        state = self._store.load(request.tenant_id)
        # The quota counts cost-weighted tokens, by the same rule billing prices with; the
        # precision is not known before a worker is picked, so settling corrects it.
        weight = cost_weight(num_prompt, "", datetime.fromtimestamp(now, UTC), self._peak_hours)
        decision = reserve(
            state,
            request.request_id,
            math.ceil((num_prompt + request.sampling.max_tokens) * weight),
            Limits(tpm=tenant.tpm, rpm=tenant.rpm),
            now,
        )
        if not decision.admitted:
            self.metrics.num_rejected_quota += 1
            await self._refuse(
                request,
                ErrorInfo(
                    code="quota_exceeded",
                    message=(
                        f"tenant {request.tenant_id!r}: {decision.reason}; used "
                        f"{decision.num_tokens_used} of {tenant.tpm} tokens and "
                        f"{decision.num_requests_used} of {tenant.rpm} requests in the last 60 s"
                    ),
                    retry_after_s=round(decision.retry_after_s, 3) or None,
                ),
            )
            return Outcome.REFUSED
        if decision.duplicate:
            self.metrics.num_duplicates += 1
            return Outcome.DUPLICATE
        self._store.save(request.tenant_id, state)
        self.metrics.num_admitted += 1

        waiting = _Waiting(request, asyncio.get_running_loop().create_future(), time.monotonic())
        self._waiting[request.request_id] = waiting
        self._queue.push(
            request.request_id,
            waiting,
            tenant=request.tenant_id,
            priority=priority,
            weight=tenant.weight,
            num_input=num_prompt,
            num_output=request.sampling.max_tokens,
        )
        self._wake.set()
        outcome = await waiting.done
        if outcome is not Outcome.FORWARDED:
            # Never ran: give the tenant its reservation back (in this agent's context).
            state = self._store.load(request.tenant_id)
            release(state, request.request_id, self._clock())
            self._store.save(request.tenant_id, state)
        return outcome

    def _check_tenant_rules(self, request: InferenceRequest, num_prompt: int) -> ErrorInfo | None:
        tenant = self._tenants.get(request.tenant_id)
        if not tenant.may_use(request.model):
            return ErrorInfo(
                code="model_not_allowed",
                message=f"tenant {request.tenant_id!r} may not use {request.model!r}",
            )
        if num_prompt > tenant.max_prompt_tokens:
            return ErrorInfo(
                code="prompt_too_long",
                message=f"prompt has {num_prompt} tokens; tenant "
                f"{request.tenant_id!r} allows {tenant.max_prompt_tokens}",
            )
        if request.sampling.max_tokens > tenant.max_output_tokens:
            return ErrorInfo(
                code="invalid_request",
                message=f"sampling.max_tokens {request.sampling.max_tokens} is above "
                f"the tenant's max_output_tokens {tenant.max_output_tokens}",
            )
        return None

    # -- observations (usage runs in the tenant's agent; the rest anywhere) ----------------
    def note_lag(self, stream: str, since: float) -> None:
        """Samples the lag of one input (``since``: epoch seconds) for the metrics."""
        samples = self.metrics.lag_ms.setdefault(stream, [])
        samples.append(max(0.0, time.time() - since) * 1000)
        del samples[:-1000]

    def observe_usage(self, value: bytes | None) -> None:
        """Settles the window on the real count, frees the slot, corrects the VTC counter."""
        try:
            usage = decode(UsageEvent, value)
        except SchemaError:
            return  # the billing sink dead-letters usage it cannot read
        self.note_lag("usage_since_finish", usage.finished_at.timestamp())
        state = self._store.load(usage.tenant_id)
        weight = cost_weight(
            usage.num_prompt_tokens, usage.precision, usage.created_at, self._peak_hours
        )
        actual = math.ceil((usage.num_prompt_tokens + usage.num_completion_tokens) * weight)
        if settle(state, usage.request_id, actual, self._clock()) is not None:
            self._store.save(usage.tenant_id, state)
        flight = self._in_flight.get(usage.request_id)
        if flight is not None and flight.request.attempt == usage.attempt:
            del self._in_flight[usage.request_id]
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
        self.note_lag("heartbeats", status.sent_at.timestamp())
        age = (datetime.now(UTC) - status.sent_at).total_seconds()
        if age > self._settings.worker_dead_after_s:
            return  # an old heartbeat read on start-up says nothing about now
        self._registry.observe(status, time.monotonic())
        self.metrics.workers = {
            view.status.worker_id: view.status for view in self._registry.all_live(time.monotonic())
        }
        self._wake.set()

    async def handle_cancel(self, value: bytes | None) -> None:
        try:
            cancel = decode(CancelRequest, value)
        except SchemaError as exc:
            log.warning("ignoring a malformed cancel: %s", exc)
            return
        if cancel.reason == REASSIGNED:
            return  # our own, to the worker we took the request from
        flight = self._in_flight.get(cancel.request_id)
        if flight is not None and flight.request.tenant_id == cancel.tenant_id:
            flight.cancelled = True  # its worker aborts it; if that worker is lost, so do we
            return
        waiting = self._waiting.pop(cancel.request_id, None)
        if waiting is None or waiting.request.tenant_id != cancel.tenant_id:
            return  # finished, or not this tenant's
        self._queue.remove(cancel.request_id)
        self.metrics.num_cancelled_waiting += 1
        await self._answer(
            waiting.request,
            FinishReason.ABORT,
            UsageStatus.CANCELLED,
            ErrorInfo(code="cancelled", message=cancel.reason),
        )
        waiting.done.set_result(Outcome.CANCELLED)
        self._update_tier()

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
            for run in self._registry.reap(time.monotonic()):
                self._recover_from(run)
            while (priority := self._queue.peek_priority()) is not None:
                if not self._has_room(priority):
                    break
                waiting = self._queue.pop(priority)
                assert waiting is not None
                self._waiting.pop(waiting.request.request_id, None)
                # Picked and counted in flight now; the broker's ack is awaited in a
                # task of its own, so the next pick (a class 0 request, say) does not
                # wait one produce round trip per request picked before it.
                task = asyncio.create_task(self._forward(waiting, self._pick(waiting)))
                self._forwarding.add(task)
                task.add_done_callback(self._forwarding.discard)
            self._update_tier()

    async def _forward(self, waiting: _Waiting, picked: _Picked | None) -> None:
        try:
            outcome = await self._send(waiting, picked)
        except Exception as exc:  # not forwarded: the agent fails, Faust redelivers
            if not waiting.done.done():  # its agent may have been cancelled meanwhile
                waiting.done.set_exception(exc)
        else:
            if not waiting.done.done():
                waiting.done.set_result(outcome)

    def _capacity(self) -> int:
        return sum(view.status.max_num_seqs for view in self._registry.all_live(time.monotonic()))

    def _has_room(self, priority: int) -> bool:
        capacity = self._capacity()
        if capacity == 0:
            # Just started: wait one heartbeat period to learn the fleet, rather than
            # refusing requests that a live worker could serve. After that, no live
            # worker means dispatching answers with no_worker at once.
            return time.monotonic() - self._started_at >= self._settings.worker_dead_after_s
        reserved = 0 if priority == 0 else math.ceil(capacity * self._settings.vip_reserve)
        return len(self._in_flight) < max(1, capacity - reserved)

    async def _dispatch(self, waiting: _Waiting) -> Outcome:
        return await self._send(waiting, self._pick(waiting))

    async def _send(self, waiting: _Waiting, picked: _Picked | None) -> Outcome:
        """Forwards a picked request, or answers no_worker when nothing could be picked."""
        if picked is None:
            self.metrics.num_no_worker += 1
            live = sorted(self._registry.models(time.monotonic()))
            await self._refuse(
                waiting.request,
                ErrorInfo(
                    code="no_worker",
                    message=f"no live worker serves model {waiting.request.model!r}"
                    f" (served now: {', '.join(live) or 'none'})",
                    retry_after_s=1.0,
                ),
            )
            return Outcome.REFUSED
        forwarded, topic = picked
        try:
            await self._publish(topic, forwarded.tenant_id.encode(), encode(forwarded))
        except Exception:
            self._in_flight.pop(forwarded.request_id, None)
            raise
        self.metrics.num_dispatched += 1
        return Outcome.FORWARDED

    def _pick(self, waiting: _Waiting) -> _Picked | None:
        """Chooses the worker and counts the request in flight there, without awaiting,
        so that ``_has_room`` and the routing of the next pick already see it. Returns
        the copy to forward and the worker's topic (the worker may be gone by the send)."""
        request = waiting.request
        now = time.monotonic()
        session = (request.tenant_id, request.session_id)
        previous = self._affinity.get(session)
        candidates = [view.candidate() for view in self._registry.live(request.model, now)]
        chosen = choose(candidates, request.priority, self._routing, previous=previous)
        worker = self._registry.get(chosen.worker_id) if chosen is not None else None
        if worker is None:
            return None
        if previous == worker.status.worker_id:
            self.metrics.num_affine += 1
        forwarded = request.model_copy(
            update={
                "worker_id": worker.status.worker_id,
                "worker_incarnation": worker.status.incarnation,
                "dispatched_at": datetime.now(UTC),
            }
        )
        self._in_flight[request.request_id] = _InFlight(forwarded)
        self._registry.note_dispatch(worker.status.worker_id)
        self._affinity[session] = worker.status.worker_id
        self._affinity.move_to_end(session)
        if len(self._affinity) > self._settings.affinity_sessions:
            self._affinity.popitem(last=False)
        samples = self.metrics.queue_ms_by_class[request.priority]
        samples.append((now - waiting.received_at) * 1000)
        del samples[:-1000]
        return forwarded, worker.status.request_topic

    # -- failover -------------------------------------------------------------------------
    def _recover_from(self, run: tuple[str, str]) -> None:
        """A worker run is gone: each request it held is finished or sent elsewhere."""
        lost = [flight for flight in self._in_flight.values() if flight.worker == run]
        self.metrics.num_workers_lost += 1
        log.warning("worker %s (run %s) is gone with %d requests", run[0], run[1], len(lost))
        for session, worker_id in list(self._affinity.items()):
            if worker_id == run[0]:
                del self._affinity[session]
        for flight in lost:
            task = asyncio.create_task(self._recover(flight))
            self._recoveries.add(task)
            task.add_done_callback(self._recoveries.discard)

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
            await self._publish(self._topics.cancels, key, encode(reassigned))
        except Exception:
            log.exception("could not tell %s's old worker to drop it", request.request_id)
        try:
            progress = delivered(
                await self._replies.read(request), request.request_id, request.tenant_id
            )
        except Exception:
            log.exception("could not read the replies of %s; it starts again", request.request_id)
            progress = Delivered()
        if self._in_flight.get(request.request_id) is not flight:
            return  # its UsageEvent arrived meanwhile: the worker had finished it
        del self._in_flight[request.request_id]
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
        waiting = _Waiting(again, asyncio.get_running_loop().create_future(), time.monotonic())
        try:
            await self._dispatch(waiting)
        except Exception:
            log.exception("could not send %s again", request.request_id)
            self._in_flight.pop(request.request_id, None)
            await self._answer(
                again,
                FinishReason.ERROR,
                UsageStatus.FAILED,
                ErrorInfo(code="worker_lost", message="its worker was lost; resending failed"),
            )
        self._wake.set()

    async def _publish_usage(self, request: InferenceRequest, progress: Delivered) -> None:
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
        )
        await self._publish(self._topics.usage, request.tenant_id.encode(), encode(usage))

    def _update_tier(self, extra_waiting: int = 0) -> None:
        capacity = self._capacity()
        demand = demand_ratio(len(self._in_flight), len(self._queue) + extra_waiting, capacity)
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
            self.metrics.tier_changed_at = time.time()

    # -- answers ------------------------------------------------------------------------------
    async def _refuse(
        self, request: InferenceRequest, error: ErrorInfo, tier: Tier = Tier.NORMAL
    ) -> None:
        await self._answer(
            request.model_copy(update={"overload_tier": int(tier)}),
            FinishReason.REJECTED,
            UsageStatus.REJECTED,
            error,
        )

    async def _answer(
        self, request: InferenceRequest, finish: FinishReason, status: UsageStatus, error: ErrorInfo
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
        )
        batch = TokenChunkBatch(tenant_id=request.tenant_id, chunks=[chunk])
        await asyncio.gather(
            self._publish(request.reply_to, reply_batch_key(request.tenant_id), encode(batch)),
            self._publish(self._topics.usage, request.tenant_id.encode(), encode(usage)),
        )
