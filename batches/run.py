"""One batch, from its prepared lines to its output files: a thin I/O shell.

# store: PreparedLines + BatchDoc --> BatchRun
# reply topic, from its start --> tokenbus.chunks --> BatchLog (batches.progress): done lines
# lines not done, as the pacer allows --> TokenbusClient.submit (class 2, batch_id) --> requests.p2
# control.decide (cancel, expiry, all done) --> finalize: the topic folded again --> output files
# every batch_status_interval_s --> the BatchDoc in the store

Exactly once: a line's request ids are fixed by the line and the refusals on the topic
(``batches.progress``), and the reply topic is read from its start before anything is
produced. A line already done is never produced again. A line produced before a crash
and not yet done is produced again under the same id: the job's ledger answers a
running copy with nothing (the first run's chunks keep coming to this topic) and a
finished one with ``duplicate_request`` (its result is on this topic, which the fold
reads), so every line has one result, and one run that billing sees.

Commits: none. The reply topic is the batch's log and is always read whole; nothing is
skipped, so nothing can be lost. Records that are not good reply batches go to the
dead-letter topic and are skipped.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from batches.control import ENDING_ERRORS, Ending, Pace, decide
from batches.metrics import RunnerMetrics
from batches.output import error_line, output_line
from batches.pacing import Pacer
from batches.progress import BatchLog, LineResult, Retry, line_request_id
from producers import TokenbusClient
from schemas import FinishReason, InferenceRequest, SchemaError
from schemas.batches import BatchDoc, FileDoc, LineError, OutputLine, PreparedLine
from tokenbus.auth import ServiceTokens
from tokenbus.batch.store import BatchStore
from tokenbus.chunks import decode_batch
from tokenbus.config import Settings
from tokenbus.dlq import dead_letter_record
from tokenbus.ids import ulid
from tokenbus.kafka import make_consumer, publisher
from tokenbus.topics import Topics, reply_batch_key

log = logging.getLogger(__name__)
Clock = Callable[[], float]
FINALIZE_READ_S = 300.0
"""Finalization reads the reply topic back at most this long for the results it saw."""
CAUGHT_UP_MS = 1_000
"""A fetch of the reply topic that stays empty this long: the replay has caught up."""


class BatchRun:
    def __init__(
        self,
        settings: Settings,
        store: BatchStore,
        doc: BatchDoc,
        pacer: Pacer,
        metrics: RunnerMetrics,
        dead_letters: AIOKafkaProducer,
        clock: Clock = time.time,
    ) -> None:
        self._settings = settings
        self._store = store
        self.doc = doc
        self.pacer = pacer
        self._metrics = metrics
        self.dead_letters = dead_letters
        self._clock = clock
        self._topics = Topics(settings.topic_prefix)
        self._topic = self._topics.batch_replies(doc.tenant, doc.id)
        self.cancel_requested = doc.status == "cancelling"
        self._in_flight: dict[int, InferenceRequest] = {}
        self._pace = Pace()
        secret = settings.bus_service_secret
        self._tokens = ServiceTokens(secret) if secret else None

    def cancel(self) -> None:
        self.cancel_requested = True

    # -- the run ------------------------------------------------------------------------
    async def run(self) -> None:
        tenant, batch_id = self.doc.tenant, self.doc.id
        lines = await asyncio.to_thread(self._store.lines, tenant, batch_id)
        submit_errors = await asyncio.to_thread(self._store.line_errors, tenant, batch_id)
        by_no = {line.line_no: line for line in lines}
        fold = BatchLog(batch_id, set(by_no))
        client = TokenbusClient(
            self._settings, f"batch-{batch_id}", tenant_id=tenant, reply_reader=False
        )
        await client.start()  # creates the reply topic, if this is the batch's first run
        assert client.reply_topic == self._topic
        try:
            consumer = await self._reader()
            try:
                await self._read(consumer, fold, until_caught_up=True)
                log.info(
                    "%s/%s: %d of %d lines done on its reply topic; resuming",
                    tenant, batch_id, len(fold.done), len(lines),
                )  # fmt: skip
                now = self._clock()
                if self.doc.in_progress_at is None:
                    self.doc.in_progress_at = int(now)
                if self.doc.status == "validating":
                    self.doc.status = "in_progress"
                await self._save(fold, submit_errors)
                ending = await self._drive(client, consumer, fold, by_no, submit_errors)
            finally:
                await consumer.stop()
            await self._finalize(ending, by_no, submit_errors, fold)
        finally:
            await client.close()
            self._metrics.forget(tenant, batch_id)

    async def _drive(
        self,
        client: TokenbusClient,
        consumer: AIOKafkaConsumer,
        fold: BatchLog,
        by_no: dict[int, PreparedLine],
        submit_errors: list[LineError],
    ) -> Ending:
        pending = deque(n for n in sorted(by_no) if not fold.is_done(n))
        retries: list[tuple[float, int]] = []  # (due, line_no)
        aborted = False
        saved_at = 0.0
        expires_at = float(self.doc.expires_at or 0)
        while True:
            now = self._clock()
            step = decide(
                now,
                expires_at=expires_at,
                cancel_requested=self.cancel_requested,
                num_left=len(by_no) - len(fold.done),
                num_in_flight=len(self._in_flight),
                grace_s=self._settings.batch_expiry_grace_s,
            )
            if step.status == "cancelling" and self.doc.status != "cancelling":
                self.doc.status = "cancelling"
                self.doc.cancelling_at = int(now)
                saved_at = 0.0
            if step.abort_running and not aborted:
                aborted = True
                for request in list(self._in_flight.values()):
                    await client.cancel(request, "batch_expired")
            if step.end is not None:
                return step.end
            if step.dispatch:
                while len(self._in_flight) < self.pacer.limit():
                    line_no = _next_line(pending, retries, now, fold)
                    if line_no is None:
                        break
                    self._in_flight[line_no] = await client.submit(
                        credential=self._credential(by_no[line_no], client.reply_prefix),
                        tenant_id=self.doc.tenant,
                        prompt=by_no[line_no].prompt,
                        messages=by_no[line_no].messages,
                        model=by_no[line_no].model,
                        priority=2,
                        sampling=by_no[line_no].sampling,
                        session_id=line_request_id(self.doc.id, line_no),
                        request_id=line_request_id(self.doc.id, line_no, fold.retry_of(line_no)),
                        batch_id=self.doc.id,
                    )
            for outcome in await self._read(consumer, fold, until_caught_up=False):
                self._in_flight.pop(outcome.line_no, None)
                if isinstance(outcome, Retry):
                    heapq.heappush(retries, (now + outcome.retry_after_s, outcome.line_no))
            if now - saved_at >= self._settings.batch_status_interval_s:
                saved_at = now
                await self._save(fold, submit_errors)

    def _credential(self, line: PreparedLine, reply_prefix: str) -> str | None:
        """The token a line goes out with: bound as the creating credential's own requests
        are (its key's budgets and usage, its token's balance) and with the line's
        screening flags; None, the client's own token, when there is nothing to bind."""
        bound = self.doc.credential
        if self._tokens is None or (bound is None and not line.flags):
            return None
        return self._tokens.token(
            self.doc.tenant,
            reply_prefix,
            quota_balance=bound.quota_balance if bound else None,
            flags=tuple(line.flags),
            key_sha256=bound.key_sha256 if bound else None,
        )

    async def _finalize(
        self,
        ending: Ending,
        by_no: dict[int, PreparedLine],
        submit_errors: list[LineError],
        live: BatchLog,
    ) -> None:
        """The output and error files, from the reply topic folded again: the same fold
        gives the same one result per line, however often the runner restarted."""
        now = self._clock()
        self.doc.status = "finalizing"
        self.doc.finalizing_at = int(now)
        await self._save(live, submit_errors)
        fold = BatchLog(self.doc.id, set(by_no))
        results: dict[int, LineResult] = {}
        consumer = await self._reader()
        deadline = time.monotonic() + FINALIZE_READ_S
        try:
            while not set(live.done) <= set(results):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self._topic} no longer holds every result the run saw "
                        f"({len(results)} of {len(live.done)}): the broker lost records"
                    )
                outcomes = await self._read(consumer, fold, until_caught_up=True)
                results.update((o.line_no, o) for o in outcomes if isinstance(o, LineResult))
        finally:
            await consumer.stop()
        created = int(now)
        good: list[OutputLine] = []
        bad: list[OutputLine] = []
        code, message = ENDING_ERRORS[ending]
        for line_no, line in sorted(by_no.items()):
            result = results.get(line_no)
            request_id = line_request_id(self.doc.id, line_no)
            if result is None:
                bad.append(error_line(request_id, line.custom_id, code, message))
            elif result.finish_reason is FinishReason.ABORT and ending != "completed":
                bad.append(error_line(result.request_id, line.custom_id, code, message))
            else:
                out = output_line(result, line.custom_id, self.doc.endpoint, line.model, created)
                (good if out.error is None else bad).append(out)
        for error in submit_errors:
            request_id = line_request_id(self.doc.id, error.line_no)
            reason = f"line {error.line_no}: {error.message}"
            bad.append(error_line(request_id, error.custom_id, error.code, reason))
        self.doc.output_file_id = await self._put_output(good, "output") if good else None
        self.doc.error_file_id = await self._put_output(bad, "error") if bad else None
        self.doc.request_counts.completed = len(good)
        self.doc.request_counts.failed = len(bad)
        self.doc.in_flight = 0
        self.doc.eta_s = None
        self.doc.status = ending
        done_at = int(self._clock())
        if ending == "completed":
            self.doc.completed_at = done_at
        elif ending == "cancelled":
            self.doc.cancelled_at = done_at
        else:
            self.doc.expired_at = done_at
        self._set_usage(fold)
        await asyncio.to_thread(self._store.put_batch, self.doc)
        log.info(
            "%s/%s %s: %d output lines, %d error lines",
            self.doc.tenant, self.doc.id, ending, len(good), len(bad),
        )  # fmt: skip

    # -- I/O helpers ----------------------------------------------------------------------
    async def _reader(self) -> AIOKafkaConsumer:
        consumer = make_consumer(self._settings, group_id=None)
        await consumer.start()
        tp = TopicPartition(self._topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        return consumer

    async def _read(
        self, consumer: AIOKafkaConsumer, fold: BatchLog, *, until_caught_up: bool
    ) -> list[LineResult | Retry]:
        """Folds what the topic has: one fetch, or (``until_caught_up``) fetches until
        one stays empty for ``CAUGHT_UP_MS``."""
        outcomes: list[LineResult | Retry] = []
        key = reply_batch_key(self.doc.tenant)
        while True:
            fetched = await consumer.getmany(timeout_ms=CAUGHT_UP_MS if until_caught_up else 100)
            for records in fetched.values():
                for record in records:
                    try:
                        batch = decode_batch(record.value)
                        if record.key != key or batch.tenant_id != self.doc.tenant:
                            raise SchemaError(
                                f"record key {record.key!r} or tenant {batch.tenant_id!r} is "
                                f"not the batch's tenant {self.doc.tenant!r}"
                            )
                    except SchemaError as exc:
                        await dead_letter_record(
                            publisher(self.dead_letters),
                            self._topics,
                            record,
                            consumer=f"batches/{self.doc.id}",
                            reason=str(exc),
                        )
                        continue
                    for chunk in batch.chunks:
                        outcome = fold.apply(chunk)
                        if outcome is not None:
                            outcomes.append(outcome)
            if not until_caught_up or not fetched:
                return outcomes

    async def _save(self, fold: BatchLog, submit_errors: list[LineError]) -> None:
        now = self._clock()
        counts = self.doc.request_counts
        counts.completed = fold.num_completed
        counts.failed = fold.num_failed + len(submit_errors)
        self.doc.in_flight = len(self._in_flight)
        num_left = counts.total - counts.completed - counts.failed
        self._pace.observe(now, counts.completed + counts.failed)
        self.doc.eta_s = self._pace.eta_s(num_left)
        self._set_usage(fold)
        self._metrics.observe(self.doc, num_left)
        await asyncio.to_thread(self._store.put_batch, self.doc)

    def _set_usage(self, fold: BatchLog) -> None:
        usage = self.doc.usage
        usage.input_tokens = fold.num_prompt_tokens
        usage.output_tokens = fold.num_completion_tokens
        usage.total_tokens = fold.num_prompt_tokens + fold.num_completion_tokens

    async def _put_output(self, lines: list[OutputLine], kind: str) -> str:
        data = b"".join(line.model_dump_json().encode() + b"\n" for line in lines)
        doc = FileDoc(
            id=f"file-{ulid()}",
            bytes=len(data),
            created_at=int(self._clock()),
            filename=f"{self.doc.id}_{kind}.jsonl",
            purpose="batch_output",
            tenant=self.doc.tenant,
        )
        await asyncio.to_thread(self._store.put_file, doc, data)
        return doc.id


def _next_line(
    pending: deque[int], retries: list[tuple[float, int]], now: float, fold: BatchLog
) -> int | None:
    """The next line to produce: a refused line whose wait is over, else the next new one."""
    while retries and retries[0][0] <= now:
        line_no = heapq.heappop(retries)[1]
        if not fold.is_done(line_no):
            return line_no
    while pending:
        line_no = pending.popleft()
        if not fold.is_done(line_no):
            return line_no
    return None
