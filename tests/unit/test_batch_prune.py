"""The rule for which batches' reply topics an operator may prune."""

from __future__ import annotations

from typing import Any

from schemas.batches import BatchDoc, BatchStatus
from tokenbus.batch.prune import ended_at, keep_reason

NOW = 1_800_000_000.0
DAY = 86_400.0


def doc(status: BatchStatus, **times: Any) -> BatchDoc:
    return BatchDoc(
        id="batch_0123456789ab",
        endpoint="/v1/chat/completions",
        input_file_id="file-0123456789ab",
        completion_window="24h",
        status=status,
        created_at=int(NOW - 30 * DAY),
        tenant="acme",
        **times,
    )


def test_a_batch_that_ended_long_enough_ago_may_lose_its_topic() -> None:
    ends: tuple[tuple[BatchStatus, str], ...] = (
        ("completed", "completed_at"),
        ("failed", "failed_at"),
        ("expired", "expired_at"),
        ("cancelled", "cancelled_at"),
    )
    for status, field in ends:
        ended = doc(status, **{field: int(NOW - 8 * DAY)})
        assert ended_at(ended) == int(NOW - 8 * DAY)
        assert keep_reason(ended, NOW, 7 * DAY) is None, status


def test_a_topic_stays_unless_its_batch_is_known_to_have_ended_long_ago() -> None:
    recent = doc("completed", completed_at=int(NOW - 3600))
    assert keep_reason(recent, NOW, 7 * DAY) == "the batch ended 3600 s ago"
    running = doc("in_progress", in_progress_at=int(NOW - 30 * DAY))
    assert ended_at(running) is None
    assert keep_reason(running, NOW, 0) == "the batch is in_progress"
    assert keep_reason(doc("cancelling"), NOW, 0) == "the batch is cancelling"
    assert keep_reason(doc("failed"), NOW, 0) == "the batch is failed, with no time it ended"
    assert keep_reason(None, NOW, 0) == "no status document in the store"
