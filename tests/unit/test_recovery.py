from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import FinishReason
from stream_jobs.recovery import RESUMED, Delivered, delivered, resume
from tests.unit.fakes import work_item as request
from tokenbus.chunks import Chunk


def chunk(
    seq: int,
    token_ids: list[int],
    *,
    request_id: str = "r1",
    tenant_id: str = "t1",
    finish: FinishReason | None = None,
) -> Chunk:
    return Chunk(
        request_id=request_id,
        tenant_id=tenant_id,
        seq=seq,
        token_ids=token_ids,
        num_tokens=len(token_ids),
        finish_reason=finish,
    )


STREAM = [chunk(0, [1, 2]), chunk(1, [3]), chunk(2, [4, 5, 6])]


def test_in_order_chunks() -> None:
    result = delivered(STREAM, "r1", "t1")
    assert result.token_ids == [1, 2, 3, 4, 5, 6]
    assert result.next_seq == 3
    assert result.num_chunks == 3
    assert result.last is None


def test_nothing_delivered() -> None:
    assert delivered([], "r1", "t1") == Delivered([], 0, None, 0)


def test_shuffled_chunks() -> None:
    result = delivered([STREAM[2], STREAM[0], STREAM[1]], "r1", "t1")
    assert result.token_ids == [1, 2, 3, 4, 5, 6]
    assert result.next_seq == 3


def test_a_duplicated_chunk_counts_once() -> None:
    result = delivered([STREAM[0], STREAM[1], STREAM[0], STREAM[1], STREAM[2]], "r1", "t1")
    assert result.token_ids == [1, 2, 3, 4, 5, 6]
    assert result.next_seq == 3
    assert result.num_chunks == 3


def test_a_gap_stops_the_prefix() -> None:
    result = delivered([STREAM[0], STREAM[2], chunk(3, [7], finish=FinishReason.STOP)], "r1", "t1")
    assert result.token_ids == [1, 2]
    assert result.next_seq == 1
    assert result.last is None


def test_a_missing_first_chunk_means_nothing_delivered() -> None:
    result = delivered([STREAM[1], STREAM[2]], "r1", "t1")
    assert result.token_ids == []
    assert result.next_seq == 0


def test_chunks_of_other_requests_and_tenants_are_ignored() -> None:
    noise = [
        chunk(0, [99], request_id="r2"),
        chunk(1, [98], request_id="r2"),
        chunk(0, [97], tenant_id="t2"),
        chunk(1, [96], tenant_id="t2"),
        chunk(2, [95], tenant_id="t2", finish=FinishReason.STOP),
    ]
    result = delivered([noise[0], noise[2], STREAM[0], *noise[1:], STREAM[1]], "r1", "t1")
    assert result.token_ids == [1, 2, 3]
    assert result.next_seq == 2
    assert result.last is None


def test_a_finished_stream() -> None:
    last = chunk(3, [7], finish=FinishReason.LENGTH)
    stray = chunk(4, [8])
    result = delivered([stray, last, *reversed(STREAM)], "r1", "t1")
    assert result.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert result.last == last
    assert result.next_seq == 4
    assert result.num_chunks == 4


def test_resume_after_partial_delivery() -> None:
    original = request()
    progress = delivered(STREAM, "r1", "t1")
    again = resume(original, progress)
    assert again.attempt == 1
    assert again.worker_id is None
    assert again.worker_incarnation is None
    assert again.dispatched_at is None
    assert again.resume_token_ids == [1, 2, 3, 4, 5, 6]
    assert again.resume_seq == 3
    assert again.flags == ["max_tokens_capped", RESUMED]
    # Everything else is the same request.
    assert again.request_id == original.request_id
    assert again.prompt == original.prompt
    assert again.created_at == original.created_at
    assert again.admitted_at == original.admitted_at
    # The original is untouched.
    assert original.attempt == 0 and original.worker_id == "w1"
    assert original.flags == ["max_tokens_capped"]


def test_resume_with_nothing_delivered_is_not_flagged() -> None:
    again = resume(request(), delivered([], "r1", "t1"))
    assert again.attempt == 1
    assert again.worker_id is None and again.worker_incarnation is None
    assert again.dispatched_at is None
    assert again.resume_token_ids == []
    assert again.resume_seq == 0
    assert RESUMED not in again.flags


def test_resume_twice_flags_once_and_replaces_the_prefix() -> None:
    first = resume(request(), delivered(STREAM[:1], "r1", "t1"))
    assert first.flags.count(RESUMED) == 1
    redispatched = first.model_copy(update={"worker_id": "w2", "worker_incarnation": "inc-9"})
    more = [*STREAM, chunk(3, [7])]
    second = resume(redispatched, delivered(more, "r1", "t1"))
    assert second.attempt == 2
    assert second.flags.count(RESUMED) == 1
    assert second.resume_token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert second.resume_seq == 4
    assert second.worker_id is None and second.worker_incarnation is None


def test_resume_copies_the_delivered_token_ids() -> None:
    progress = delivered(STREAM, "r1", "t1")
    again = resume(request(), progress)
    progress.token_ids.append(42)
    assert again.resume_token_ids == [1, 2, 3, 4, 5, 6]


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.lists(st.integers(0, 200_000), max_size=5), max_size=12),
    finished=st.booleans(),
    data=st.data(),
)
def test_any_permutation_with_duplicates_rebuilds_the_stream(
    pieces: list[list[int]], finished: bool, data: st.DataObject
) -> None:
    chunks = [chunk(seq, ids) for seq, ids in enumerate(pieces)]
    if finished and chunks:
        chunks[-1] = chunk(len(pieces) - 1, pieces[-1], finish=FinishReason.STOP)
    if chunks:
        extra = data.draw(st.lists(st.sampled_from(chunks), max_size=len(chunks) * 2))
    else:
        extra = []
    noise = data.draw(
        st.lists(
            st.builds(
                lambda seq, ids, owner: chunk(seq, ids, request_id=owner[0], tenant_id=owner[1]),
                st.integers(0, 15),
                st.lists(st.integers(0, 9), max_size=3),
                st.sampled_from([("r2", "t1"), ("r1", "t2"), ("r2", "t2")]),
            ),
            max_size=6,
        )
    )
    stream = data.draw(st.permutations(chunks + extra + noise))

    result = delivered(stream, "r1", "t1")

    assert result.token_ids == [token for piece in pieces for token in piece]
    assert result.next_seq == len(pieces)
    assert result.num_chunks == len(pieces)
    if finished and chunks:
        assert result.last is not None and result.last.seq == len(pieces) - 1
    else:
        assert result.last is None
