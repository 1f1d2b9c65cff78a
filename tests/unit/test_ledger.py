"""``judge``: what the job does with a (tenant, request_id) it may have seen before."""

from __future__ import annotations

import itertools

import pytest

from stream_jobs.ledger import Entry, Forward, Reserved, State, Verdict, carried, ended, judge

NOW = 1_000.0
MINE = "tokenbus.replies.t.c1"
OTHER = "tokenbus.replies.t.c2"

# (state, in_memory, same reply_to) -> verdict, for an entry that has not expired.
# Written out in full, not derived: this is the table the README's guarantees rest on.
LIVE: dict[tuple[State, bool, bool], Verdict] = {
    # Admitted, not yet forwarded, and this instance holds it: one stream per reply topic.
    (State.ADMITTED, True, True): Verdict.SAME_STREAM,
    (State.ADMITTED, True, False): Verdict.DUPLICATE,
    # Admitted before a restart, never forwarded: admit it again, whoever asks.
    (State.ADMITTED, False, True): Verdict.RUN,
    (State.ADMITTED, False, False): Verdict.RUN,
    # On a worker (here or before a restart): it streams to the topic it named.
    (State.FORWARDED, True, True): Verdict.SAME_STREAM,
    (State.FORWARDED, True, False): Verdict.DUPLICATE,
    (State.FORWARDED, False, True): Verdict.SAME_STREAM,
    (State.FORWARDED, False, False): Verdict.DUPLICATE,
    # Finished: every copy is a duplicate.
    (State.DONE, True, True): Verdict.DUPLICATE,
    (State.DONE, True, False): Verdict.DUPLICATE,
    (State.DONE, False, True): Verdict.DUPLICATE,
    (State.DONE, False, False): Verdict.DUPLICATE,
}


def test_the_table_covers_every_state() -> None:
    assert set(LIVE) == set(itertools.product(State, (True, False), (True, False)))


@pytest.mark.parametrize(("state", "in_memory", "same"), sorted(LIVE, key=str))
def test_a_live_entry(state: State, in_memory: bool, same: bool) -> None:
    entry = Entry(state, MINE, expires_at=NOW + 1, last_seq=7)
    reply_to = MINE if same else OTHER
    assert judge(entry, reply_to, NOW, in_memory=in_memory) is LIVE[(state, in_memory, same)]


@pytest.mark.parametrize(("state", "in_memory", "same"), sorted(LIVE, key=str))
@pytest.mark.parametrize("expires_at", [NOW, NOW - 1], ids=["at-now", "before-now"])
def test_an_expired_entry_counts_as_none(
    state: State, in_memory: bool, same: bool, expires_at: float
) -> None:
    entry = Entry(state, MINE, expires_at=expires_at)
    reply_to = MINE if same else OTHER
    expected = Verdict.SAME_STREAM if in_memory else Verdict.NEW
    assert judge(entry, reply_to, NOW, in_memory=in_memory) is expected


@pytest.mark.parametrize(
    ("in_memory", "expected"), [(False, Verdict.NEW), (True, Verdict.SAME_STREAM)]
)
@pytest.mark.parametrize("reply_to", [MINE, OTHER])
def test_no_entry(in_memory: bool, expected: Verdict, reply_to: str) -> None:
    assert judge(None, reply_to, NOW, in_memory=in_memory) is expected


@pytest.mark.parametrize("state", list(State))
def test_an_entry_round_trips_through_its_table_form(state: State) -> None:
    entry = Entry(state, MINE, expires_at=NOW + 0.5, last_seq=12)
    assert Entry.from_json(entry.to_json()) == entry


def test_a_forwarded_entry_keeps_where_it_runs_and_older_entries_still_read() -> None:
    forward = Forward(home=3, topic="tokenbus.worker.w", partition=1, offset=42)
    entry = Entry(State.FORWARDED, "r", 1.5, 0, forward)
    assert Entry.from_json(entry.to_json()) == entry
    assert entry.forward is not None and entry.forward.place == ("tokenbus.worker.w", 1, 42)
    # An entry written before entries said where they run: no forward, not adopted.
    assert Entry.from_json(["forwarded", "r", 1.5, 0]) == Entry(State.FORWARDED, "r", 1.5, 0)


def test_an_entry_with_copies_owed_round_trips_with_or_without_a_forward() -> None:
    forward = Forward(home=0, topic="tokenbus.worker.w", partition=0, offset=7)
    for entry in (
        Entry(State.ADMITTED, MINE, NOW, copies=2),
        Entry(State.FORWARDED, MINE, NOW, 0, forward, copies=1),
    ):
        assert Entry.from_json(entry.to_json()) == entry
    # With none owed, the table form is the one written before copies were counted.
    assert Entry(State.DONE, MINE, NOW, 3).to_json() == ["done", MINE, NOW, 3]


def test_an_entry_keeps_its_reservation_through_the_table_form_and_its_changes() -> None:
    reserved = Reserved("t/batch", 17_672_256_000, 160, 1)
    forward = Forward(home=0, topic="tokenbus.worker.w", partition=0, offset=7)
    for entry in (
        Entry(State.FORWARDED, MINE, NOW, 0, forward, reserved=reserved),
        Entry(State.DONE, MINE, NOW, 5, reserved=reserved),
        Entry(State.ADMITTED, MINE, NOW, copies=3, reserved=reserved),
    ):
        assert Entry.from_json(entry.to_json()) == entry
        assert entry.with_copy().reserved == reserved
    assert reserved.reservation == [17_672_256_000, 160, 1]
    # Entries written before they kept reservations read as having none.
    assert Entry.from_json(["done", MINE, NOW, 3, None, 2]).reserved is None


def test_copies_owed_are_carried_from_admitted_to_forwarded() -> None:
    admitted = Entry(State.ADMITTED, MINE, NOW).with_copy().with_copy()
    forwarded = Entry(State.FORWARDED, MINE, NOW + 1, 0, Forward(0, "w", 0, 1))
    assert carried(admitted, forwarded) == Entry(
        State.FORWARDED, MINE, NOW + 1, 0, Forward(0, "w", 0, 1), copies=2
    )
    assert carried(None, forwarded) == forwarded


@pytest.mark.parametrize("copies", [0, 1, 3])
def test_a_request_that_ends_owes_each_copy_a_seq_after_its_stream(copies: int) -> None:
    running = Entry(State.FORWARDED, MINE, NOW, copies=copies)
    done, owed = ended(running, Entry(State.DONE, MINE, NOW + 5, last_seq=9))
    assert list(owed) == list(range(10, 10 + copies))
    # The next answer after these takes the seq after the last one owed.
    assert done == Entry(State.DONE, MINE, NOW + 5, last_seq=9 + copies)
    assert done.answered_once_more().last_seq == 10 + copies


def test_a_request_ended_twice_owes_nothing_more_and_takes_no_seq_back() -> None:
    running = Entry(State.ADMITTED, MINE, NOW, copies=2)
    first, owed = ended(running, Entry(State.DONE, MINE, NOW, last_seq=0))
    assert list(owed) == [1, 2]
    again, owed_again = ended(first, Entry(State.DONE, MINE, NOW + 1, last_seq=0))
    assert list(owed_again) == [] and again.last_seq == 2 and again.expires_at == NOW + 1
