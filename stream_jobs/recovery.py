"""What a lost worker had delivered, and the attempt that continues from there.

Pure. The reply topic is the record of what reached the client: every chunk the worker
had sent before it died is there, in order, and nothing else is. From those chunks the
dispatcher either finishes the books of a request that had in fact completed (its last
chunk is there but its UsageEvent is not), or sends the request again with the token
ids already delivered, so the new worker continues the same stream: the prompt plus
those ids as its prompt, and ``seq`` numbers that carry on where the stream stopped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas import WorkItem
from tokenbus.chunks import Chunk

RESUMED = "resumed"
"""Flag on a request (and its UsageEvent) sent again after its worker was lost."""


@dataclass(frozen=True)
class Delivered:
    token_ids: list[int] = field(default_factory=list)
    next_seq: int = 0
    last: Chunk | None = None
    """The chunk with a finish_reason, when the stream had ended."""
    num_chunks: int = 0


def delivered(chunks: Iterable[Chunk], request_id: str, tenant_id: str) -> Delivered:
    """The gapless prefix of one request's stream, from ``seq`` 0, each seq counted once."""
    by_seq: dict[int, Chunk] = {}
    for chunk in chunks:
        if chunk.request_id == request_id and chunk.tenant_id == tenant_id:
            by_seq.setdefault(chunk.seq, chunk)
    token_ids: list[int] = []
    seq = 0
    while seq in by_seq:
        chunk = by_seq[seq]
        token_ids += chunk.token_ids
        seq += 1
        if chunk.is_last:
            return Delivered(token_ids, seq, chunk, seq)
    return Delivered(token_ids, seq, None, seq)


def resume(request: WorkItem, progress: Delivered) -> WorkItem:
    """The next attempt of ``request``: it continues after what was delivered."""
    flags = list(request.flags)
    if progress.next_seq and RESUMED not in flags:
        flags.append(RESUMED)
    return request.model_copy(
        update={
            "attempt": request.attempt + 1,
            "worker_id": None,
            "worker_incarnation": None,
            "dispatched_at": None,
            "resume_token_ids": list(progress.token_ids),
            "resume_seq": progress.next_seq,
            "flags": flags,
        }
    )
