"""The UsageEvent of one request attempt, built the same way by the worker and the job.

What identifies and classifies the attempt comes from the work item; the caller adds the
counts and timings it knows. ``created_at`` is the job's time of admission, never the
producer's: it is what billing prices by. The status follows the finish reason unless given.
"""

from __future__ import annotations

from typing import Any

from schemas import FinishReason, UsageEvent, UsageStatus, WorkItem

_STATUS_OF_FINISH = {
    FinishReason.ERROR: UsageStatus.FAILED,
    FinishReason.ABORT: UsageStatus.CANCELLED,
    FinishReason.REJECTED: UsageStatus.REJECTED,
}


def usage_of(
    request: WorkItem,
    finish: FinishReason,
    *,
    status: UsageStatus | None = None,
    **fields: Any,
) -> UsageEvent:
    return UsageEvent(
        request_id=request.request_id,
        session_id=request.session_id,
        tenant_id=request.tenant_id,
        model=request.model,
        priority=request.priority,
        attempt=request.attempt,
        status=status or _STATUS_OF_FINISH.get(finish, UsageStatus.OK),
        finish_reason=finish,
        overload_tier=request.overload_tier,
        flags=fields.pop("flags", request.flags),
        adapter=request.adapter.name if request.adapter else None,
        key_sha256=request.key_sha256,
        batch_id=request.batch_id,
        created_at=request.admitted_at,
        **fields,
    )
