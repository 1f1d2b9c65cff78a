from __future__ import annotations

from batches.progress import BatchLog, LineResult, Retry, line_request_id, parse_request_id
from schemas import FinishReason
from tokenbus.chunks import Chunk, ChunkError

B = "batch_01TEST0000"


def chunk(
    request_id: str,
    seq: int,
    text: str = "",
    *,
    last: FinishReason | None = None,
    error: str | None = None,
    retry_after_s: float | None = None,
    num_prompt_tokens: int | None = None,
) -> Chunk:
    return Chunk(
        request_id=request_id,
        tenant_id="acme",
        seq=seq,
        text=text,
        num_tokens=1 if text else 0,
        finish_reason=last,
        error=ChunkError(code=error, message=error, retry_after_s=retry_after_s) if error else None,
        num_prompt_tokens=num_prompt_tokens,
    )


def test_request_ids_round_trip() -> None:
    assert line_request_id(B, 7) == f"{B}.7"
    assert line_request_id(B, 7, 2) == f"{B}.7.r2"
    assert parse_request_id(B, f"{B}.7") == (7, 0)
    assert parse_request_id(B, f"{B}.7.r2") == (7, 2)
    for other in (f"{B}x.7", f"{B}.7.r0", f"{B}.7.x1", f"{B}.a", f"{B}.7.r1.r2", "req_1", B):
        assert parse_request_id(B, other) is None


def test_a_line_ends_at_its_last_chunk_with_its_text_and_usage() -> None:
    fold = BatchLog(B, {1, 2})
    rid = line_request_id(B, 1)
    assert fold.apply(chunk(rid, 0, "he")) is None
    assert fold.apply(chunk(rid, 1, "llo")) is None
    result = fold.apply(chunk(rid, 2, "!", last=FinishReason.LENGTH, num_prompt_tokens=5))
    assert result == LineResult(1, rid, FinishReason.LENGTH, "hello!", 5, 3)
    assert result.ok
    assert fold.done == {1: True}
    assert (fold.num_prompt_tokens, fold.num_completion_tokens) == (5, 3)


def test_redelivered_chunks_and_later_copies_change_nothing() -> None:
    fold = BatchLog(B, {1})
    rid = line_request_id(B, 1)
    fold.apply(chunk(rid, 0, "a"))
    fold.apply(chunk(rid, 0, "a"))  # redelivered
    assert fold.apply(chunk(rid, 1, "b", last=FinishReason.STOP, num_prompt_tokens=2)) is not None
    # a resubmitted copy answered duplicate_request; a late redelivery of the end
    assert fold.apply(chunk(rid, 2, last=FinishReason.REJECTED, error="duplicate_request")) is None
    assert fold.apply(chunk(rid, 1, "b", last=FinishReason.STOP)) is None
    assert fold.num_completion_tokens == 2
    assert fold.done == {1: True}


def test_chunks_out_of_seq_order_assemble_by_seq() -> None:
    fold = BatchLog(B, {1})
    rid = line_request_id(B, 1)
    fold.apply(chunk(rid, 1, "b"))
    fold.apply(chunk(rid, 0, "a"))
    result = fold.apply(chunk(rid, 2, "c", last=FinishReason.STOP))
    assert isinstance(result, LineResult) and result.text == "abc"


def test_a_retryable_refusal_moves_the_line_to_its_next_id() -> None:
    fold = BatchLog(B, {3})
    first = line_request_id(B, 3)
    outcome = fold.apply(
        chunk(first, 0, last=FinishReason.REJECTED, error="quota_exceeded", retry_after_s=2.5)
    )
    assert outcome == Retry(3, 1, 2.5)
    assert fold.retry_of(3) == 1 and not fold.is_done(3)
    # a refusal without a wait backs off: 0.5 s after the first, 1 s after the second ...
    again = fold.apply(
        chunk(line_request_id(B, 3, 1), 0, last=FinishReason.REJECTED, error="no_worker")
    )
    assert again == Retry(3, 2, 1.0)
    # a late chunk of an id already refused changes nothing
    assert fold.apply(chunk(first, 1, "x", last=FinishReason.STOP)) is None
    done = fold.apply(chunk(line_request_id(B, 3, 2), 0, "ok", last=FinishReason.STOP))
    assert isinstance(done, LineResult) and done.request_id == f"{B}.3.r2"


def test_other_errors_end_the_line_as_failed() -> None:
    fold = BatchLog(B, {1, 2})
    bad = fold.apply(chunk(line_request_id(B, 1), 0, last=FinishReason.ERROR, error="engine_error"))
    assert isinstance(bad, LineResult) and not bad.ok and bad.error_code == "engine_error"
    aborted = fold.apply(chunk(line_request_id(B, 2), 0, "x", last=FinishReason.ABORT))
    assert isinstance(aborted, LineResult) and not aborted.ok
    assert (fold.num_completed, fold.num_failed) == (0, 2)


def test_the_fold_ignores_ids_that_are_not_its_lines() -> None:
    fold = BatchLog(B, {1})
    assert fold.apply(chunk(line_request_id(B, 9), 0, last=FinishReason.STOP)) is None
    assert fold.apply(chunk("req_other", 0, last=FinishReason.STOP)) is None
    assert fold.done == {}


def test_replaying_the_same_topic_rebuilds_the_same_state() -> None:
    topic = [
        chunk(line_request_id(B, 1), 0, last=FinishReason.REJECTED, error="overloaded"),
        chunk(line_request_id(B, 2), 0, "a"),
        chunk(line_request_id(B, 1, 1), 0, "b"),
        chunk(line_request_id(B, 2), 1, "c", last=FinishReason.STOP, num_prompt_tokens=4),
    ]
    folds = [BatchLog(B, {1, 2}) for _ in range(2)]
    for fold in folds:
        for c in topic:
            fold.apply(c)
    for fold in folds:
        assert fold.done == {2: True}
        assert fold.retry_of(1) == 1  # line 1 runs next (again) as .r1: the same id
        assert fold.num_prompt_tokens == 4


def test_refusals_without_a_wait_back_off_per_line_up_to_a_ceiling() -> None:
    fold = BatchLog(B, {1})
    waits = []
    for retry in range(8):
        refusal = chunk(
            line_request_id(B, 1, retry), 0, last=FinishReason.REJECTED, error="no_worker"
        )
        outcome = fold.apply(refusal)
        assert isinstance(outcome, Retry) and outcome.retry == retry + 1
        waits.append(outcome.retry_after_s)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0]
