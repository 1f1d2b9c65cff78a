"""Which batches' reply topics may go (``tokenbus batch prune-topics``). Pure.

A batch's reply topic is its results log while it runs; once it has ended, its output
and error files in the store are the results, and the topic is only retention's to
empty. Nothing deletes it by itself: a line of a cancelled or expired batch may still
send its last chunks there for a moment after the end, and a worker sending to a topic
just deleted would wait on it. So an operator prunes topics of batches that ended
long enough ago; a topic whose batch is not known to have ended stays.
"""

from __future__ import annotations

from schemas.batches import BatchDoc


def ended_at(doc: BatchDoc) -> int | None:
    """When a batch in a terminal status got there (epoch seconds), else None."""
    if not doc.is_terminal:
        return None
    ends = (doc.completed_at, doc.failed_at, doc.expired_at, doc.cancelled_at)
    return max((end for end in ends if end is not None), default=None)


def keep_reason(doc: BatchDoc | None, now: float, older_than_s: float) -> str | None:
    """Why a batch's reply topic stays, or None if it may be deleted: its batch ended at
    least ``older_than_s`` before ``now``."""
    if doc is None:
        return "no status document in the store"
    if not doc.is_terminal:
        return f"the batch is {doc.status}"
    end = ended_at(doc)
    if end is None:
        return f"the batch is {doc.status}, with no time it ended"
    if now - end < older_than_s:
        return f"the batch ended {now - end:.0f} s ago"
    return None
