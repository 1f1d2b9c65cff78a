"""Each line's state, folded from the batch's reply topic. Pure.

# reply chunk (tokenbus.chunks.Chunk) --> BatchLog.apply --> LineResult | Retry | None
# BatchLog --> what is done, each line's retry count, the counts and tokens so far

The per-batch reply topic is the batch's durable results log: the runner folds it from
the start on every (re)start, and again at finalization to write the output files, so
the same fold gives the same answer each time. A line's request ids are
``<batch_id>.<line_no>`` and, after a retryable refusal, ``<batch_id>.<line_no>.r<n>``:
a refusal on the topic is what moves a line to its next id, so the id a line runs
under next follows from the topic alone. A line ends at its first final chunk that is
not a retryable refusal; anything later for it (a copy's ``duplicate_request``, a
redelivered chunk) changes nothing, so each line has exactly one result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import FinishReason
from tokenbus.chunks import Chunk

RETRYABLE = frozenset({"quota_exceeded", "overloaded", "no_worker"})
"""Refusals that mean "not now": the line is retried after ``retry_after_s``, never failed."""
IGNORED = frozenset({"duplicate_request"})
"""A resubmitted copy's answer: the line's own result is elsewhere on the same topic."""
DEFAULT_RETRY_AFTER_S = 1.0
"""The wait after a line's second refusal that named none: 0.5 s after the first, then
doubling up to ``MAX_BACKOFF_S``."""
MAX_BACKOFF_S = 15.0


def line_request_id(batch_id: str, line_no: int, retry: int = 0) -> str:
    base = f"{batch_id}.{line_no}"
    return f"{base}.r{retry}" if retry else base


def parse_request_id(batch_id: str, request_id: str) -> tuple[int, int] | None:
    """(line_no, retry) of one of this batch's request ids; None for any other id."""
    prefix = batch_id + "."
    if not request_id.startswith(prefix):
        return None
    parts = request_id[len(prefix) :].split(".")
    if not parts[0].isdigit() or len(parts) > 2:
        return None
    retry = 0
    if len(parts) == 2:
        if not (parts[1].startswith("r") and parts[1][1:].isdigit()):
            return None
        retry = int(parts[1][1:])
        if retry == 0:
            return None
    return int(parts[0]), retry


@dataclass(frozen=True)
class LineResult:
    """A line's one result: its text and usage, or an error."""

    line_no: int
    request_id: str
    finish_reason: FinishReason
    text: str = ""
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None and self.finish_reason in (
            FinishReason.STOP,
            FinishReason.LENGTH,
        )


@dataclass(frozen=True)
class Retry:
    """A line was refused for now: run it again under ``retry`` after ``retry_after_s``."""

    line_no: int
    retry: int
    retry_after_s: float


@dataclass
class _Running:
    retry: int
    parts: dict[int, Chunk] = field(default_factory=dict)


class BatchLog:
    """The fold: feed it every chunk of the batch's reply topic, in the topic's order."""

    def __init__(self, batch_id: str, line_nos: set[int]) -> None:
        self.batch_id = batch_id
        self._line_nos = line_nos
        self._running: dict[int, _Running] = {}
        self._retries: dict[int, int] = {}
        self.done: dict[int, bool] = {}
        """line_no --> whether it succeeded: every line with a result."""
        self.num_prompt_tokens = 0
        self.num_completion_tokens = 0

    @property
    def num_completed(self) -> int:
        return sum(self.done.values())

    @property
    def num_failed(self) -> int:
        return len(self.done) - self.num_completed

    def retry_of(self, line_no: int) -> int:
        """The retry index the line runs under next (0: its first id)."""
        return self._retries.get(line_no, 0)

    def is_done(self, line_no: int) -> bool:
        return line_no in self.done

    def apply(self, chunk: Chunk) -> LineResult | Retry | None:
        ids = parse_request_id(self.batch_id, chunk.request_id)
        if ids is None or ids[0] not in self._line_nos:
            return None  # not a line of this batch (the tenant's key, another id)
        line_no, retry = ids
        if line_no in self.done or retry < self.retry_of(line_no):
            return None  # the line has its result, or this id was refused already
        if chunk.error is not None and chunk.error.code in IGNORED:
            return None
        running = self._running.get(line_no)
        if running is None or running.retry != retry:
            running = self._running[line_no] = _Running(retry)
        running.parts.setdefault(chunk.seq, chunk)  # a redelivered seq counts once
        if not chunk.is_last:
            return None
        del self._running[line_no]
        error = chunk.error
        if error is not None and error.code in RETRYABLE:
            self._retries[line_no] = retry + 1
            wait = error.retry_after_s
            if wait is None:  # no hint (no worker, say): back off, per line
                wait = min(DEFAULT_RETRY_AFTER_S * 2 ** (retry - 1), MAX_BACKOFF_S)
            return Retry(line_no, retry + 1, max(0.0, wait))
        result = _result(line_no, chunk, running.parts)
        self.done[line_no] = result.ok
        self.num_prompt_tokens += result.num_prompt_tokens
        self.num_completion_tokens += result.num_completion_tokens
        return result


def _result(line_no: int, last: Chunk, parts: dict[int, Chunk]) -> LineResult:
    ordered = [parts[seq] for seq in sorted(parts)]
    assert last.finish_reason is not None
    return LineResult(
        line_no=line_no,
        request_id=last.request_id,
        finish_reason=last.finish_reason,
        text="".join(c.text for c in ordered),
        num_prompt_tokens=last.num_prompt_tokens or 0,
        num_completion_tokens=sum(c.num_tokens for c in ordered),
        error_code=last.error.code if last.error is not None else None,
        error_message=last.error.message if last.error is not None else None,
    )
