"""Admission and dispatch: the thin shell around the quota and the worker registry.

# raw request bytes --> decoded InferenceRequest --> quota --> priority queue
# priority queue --> pick_worker --> the worker's topic (or an error chunk)

Delivery: ``handle_request`` returns only once the request has been forwarded to a
worker (acknowledged by the broker) or answered with an error chunk on its reply
topic, or parked in the dead-letter topic. The Faust agent acks the event after
``handle_request`` returns, and Faust commits only acked offsets, so a crash at any
point redelivers the request rather than losing it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from schemas import (
    ErrorInfo,
    FinishReason,
    InferenceRequest,
    SchemaError,
    TokenChunk,
    UsageEvent,
    UsageStatus,
    WorkerStatus,
    decode,
    encode,
)
from stream_jobs.quota import MinuteTokenQuota, estimate_prompt_tokens
from stream_jobs.registry import WorkerRegistry
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter
from tokenbus.kafka import Publish
from tokenbus.topics import Topics, reply_key

log = logging.getLogger(__name__)


@dataclass(order=True)
class _Pending:
    priority: int
    seq: int
    request: InferenceRequest = field(compare=False)
    done: asyncio.Future[None] = field(compare=False)
    received_at: float = field(compare=False)


@dataclass
class DispatchMetrics:
    num_admitted: int = 0
    num_rejected_quota: int = 0
    num_no_worker: int = 0
    num_dead_letters: int = 0
    num_dispatched: int = 0


class Dispatcher:
    """Admits requests against the quota and forwards them, highest priority first."""

    def __init__(self, settings: Settings, publish: Publish) -> None:
        self._settings = settings
        self._publish = publish
        self._topics = Topics(settings.topic_prefix)
        self._quota = MinuteTokenQuota()
        self._registry = WorkerRegistry(dead_after_s=settings.worker_dead_after_s)
        self._queue: asyncio.PriorityQueue[_Pending] = asyncio.PriorityQueue()
        self._seq = itertools.count()
        self._reserved: dict[str, int] = {}  # request_id -> tokens reserved
        self.metrics = DispatchMetrics()

    # -- inputs ----------------------------------------------------------------------
    async def handle_request(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None
    ) -> None:
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
            return

        now = time.monotonic()
        prompt_text = request.prompt or "".join(m.content for m in request.messages or [])
        reserve = estimate_prompt_tokens(prompt_text) + request.sampling.max_tokens
        limit = self._settings.tpm_for(request.tenant_id)
        admission = self._quota.reserve_tokens(request.tenant_id, reserve, limit, now)
        if not admission.admitted:
            self.metrics.num_rejected_quota += 1
            await self._refuse(
                request,
                ErrorInfo(
                    code="quota_exceeded",
                    message=(
                        f"tenant {request.tenant_id!r} would use {admission.used + reserve} "
                        f"of its {limit} tokens per minute"
                    ),
                    retry_after_s=round(admission.retry_after_s, 3),
                ),
            )
            return
        self.metrics.num_admitted += 1
        self._reserved[request.request_id] = reserve

        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(request.priority, next(self._seq), request, done, now))
        await done

    def observe_heartbeat(self, value: bytes | None) -> None:
        try:
            status = decode(WorkerStatus, value)
        except SchemaError as exc:
            log.warning("ignoring a malformed heartbeat: %s", exc)
            return
        self._registry.observe(status, time.monotonic())

    def observe_usage(self, value: bytes | None) -> None:
        """Settles a request's reservation on the tokens it really used."""
        try:
            usage = decode(UsageEvent, value)
        except SchemaError:
            return  # the billing sink dead-letters usage it cannot read
        reserved = self._reserved.pop(usage.request_id, None)
        if reserved is not None:
            actual = usage.num_prompt_tokens + usage.num_completion_tokens
            self._quota.reconcile_usage(usage.tenant_id, reserved, actual, time.monotonic())

    # -- the dispatch loop -------------------------------------------------------------
    async def run(self) -> None:
        """Forwards queued requests, lowest priority number first, FIFO within a class."""
        while True:
            pending = await self._queue.get()
            try:
                await self._dispatch(pending)
            except Exception as exc:  # an unforwarded request must be redelivered, not lost
                if not pending.done.done():
                    pending.done.set_exception(exc)
            else:
                if not pending.done.done():
                    pending.done.set_result(None)

    async def _dispatch(self, pending: _Pending) -> None:
        request = pending.request
        worker = self._registry.pick_worker(request.model, time.monotonic())
        if worker is None:
            self.metrics.num_no_worker += 1
            live = sorted(self._registry.models(time.monotonic()))
            await self._refuse(
                request,
                ErrorInfo(
                    code="no_worker",
                    message=(
                        f"no live worker serves model {request.model!r}"
                        f" (served now: {', '.join(live) or 'none'})"
                    ),
                    retry_after_s=1.0,
                ),
            )
            return
        queue_ms = (time.monotonic() - pending.received_at) * 1000
        forwarded = request.model_copy(
            update={"worker_id": worker.status.worker_id, "dispatched_at": datetime.now(UTC)}
        )
        await self._publish(
            worker.status.request_topic, request.tenant_id.encode(), encode(forwarded)
        )
        self.metrics.num_dispatched += 1
        log.debug("dispatched %s to %s after %.1f ms", request.request_id, worker, queue_ms)

    async def _refuse(self, request: InferenceRequest, error: ErrorInfo) -> None:
        """Answers the client at once, and records the refusal for billing."""
        reserved = self._reserved.pop(request.request_id, None)
        if reserved is not None:
            self._quota.reconcile_usage(request.tenant_id, reserved, 0, time.monotonic())
        chunk = TokenChunk(
            request_id=request.request_id,
            tenant_id=request.tenant_id,
            seq=0,
            finish_reason=FinishReason.REJECTED,
            error=error,
        )
        usage = UsageEvent(
            request_id=request.request_id,
            session_id=request.session_id,
            tenant_id=request.tenant_id,
            model=request.model,
            priority=request.priority,
            attempt=request.attempt,
            status=UsageStatus.REJECTED,
            finish_reason=FinishReason.REJECTED,
            error_code=error.code,
            created_at=request.created_at,
        )
        await asyncio.gather(
            self._publish(
                request.reply_to, reply_key(request.tenant_id, request.request_id), encode(chunk)
            ),
            self._publish(self._topics.usage, request.tenant_id.encode(), encode(usage)),
        )
