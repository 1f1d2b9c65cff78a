from __future__ import annotations

from producers.reply_topics import NAMES, RETIRE_AFTER_S, ReplyTopics
from tests.unit.fakes import ManualClock

BASE = "tb.replies.c1"


def test_without_rolling_a_client_has_one_topic_named_exactly() -> None:
    topics = ReplyTopics(BASE, None)
    assert not topics.rolls
    assert topics.current == BASE and topics.prefix == BASE
    assert topics.wants_next(10**9) is None
    assert topics.switch(10**9) is None
    assert topics.read == [BASE] == topics.owned


def test_the_next_topic_is_made_at_half_and_taken_when_full() -> None:
    clock = ManualClock()
    topics = ReplyTopics(BASE, 100, clock=clock)
    assert topics.rolls
    assert topics.current == f"{BASE}.0" and topics.prefix == f"{BASE}."
    assert topics.wants_next(49) is None
    assert topics.wants_next(50) == f"{BASE}.1"
    assert topics.wants_next(60) is None  # asked once
    assert topics.switch(100) is None  # full, but the next one is not there yet
    topics.ready(f"{BASE}.1", 0)
    assert topics.owned == [f"{BASE}.0", f"{BASE}.1"]
    assert topics.switch(99) is None
    assert topics.switch(100) == 0  # read from where its partition ended when made
    assert topics.current == f"{BASE}.1"
    assert topics.read == [f"{BASE}.0", f"{BASE}.1"]  # the old one is still read
    # Each topic the client replies to is under its prefix.
    assert all(t.startswith(topics.prefix) and t != topics.prefix for t in topics.owned)


def test_a_failed_creation_is_asked_for_again() -> None:
    topics = ReplyTopics(BASE, 100)
    wanted = topics.wants_next(50)
    assert wanted is not None
    topics.not_ready(wanted)
    assert topics.wants_next(51) == wanted


def test_an_old_topic_is_dropped_once_no_stream_reads_it_and_the_grace_passed() -> None:
    clock = ManualClock()
    topics = ReplyTopics(BASE, 10, clock=clock)
    topics.ready(topics.wants_next(5) or "", 0)
    assert topics.switch(10) == 0
    old = f"{BASE}.0"
    clock.advance(RETIRE_AFTER_S - 1)
    assert topics.retire(in_use=set()) == []  # answers after a stream's end may come
    clock.advance(2)
    assert topics.retire(in_use={old}) == []  # a stream still reads it
    assert topics.retire(in_use={f"{BASE}.1"}) == [old]
    assert topics.read == [f"{BASE}.1"]
    assert topics.retire(in_use=set()) == []  # once


def roll(topics: ReplyTopics, clock: ManualClock, start: int = 0) -> str | None:
    """One full roll, old topics let go at once; the name made ready, if any."""
    name = topics.wants_next(10)
    if name is not None:
        topics.ready(name, start)
    topics.switch(10)
    clock.advance(RETIRE_AFTER_S)
    topics.retire(in_use=set())
    return name


def test_names_come_back_in_a_cycle_read_from_where_they_end() -> None:
    # Producers never forget a topic, and the bundled broker makes a deleted one again:
    # a bounded set of names keeps that bounded.
    clock = ManualClock()
    topics = ReplyTopics(BASE, 10, clock=clock)
    made = [roll(topics, clock) for _ in range(2 * NAMES)]
    assert made == [f"{BASE}.{n % NAMES}" for n in range(1, 2 * NAMES + 1)]
    assert topics.wants_next(10) == f"{BASE}.1"
    topics.ready(f"{BASE}.1", 1000)  # its deletion failed: 1,000 old records left in it
    assert topics.switch(10) == 1000  # none of them is read


def test_a_name_still_read_is_not_made_again() -> None:
    clock = ManualClock()
    topics = ReplyTopics(BASE, 10, clock=clock)
    for _ in range(NAMES - 1):  # each old one still read: a stream on it goes on
        topics.ready(topics.wants_next(10) or "", 0)
        assert topics.switch(10) is not None
    assert topics.read == [f"{BASE}.{n}" for n in range(NAMES)]
    assert topics.wants_next(10) is None  # .0 is still read: the current one fills on
    assert topics.switch(10**6) is None
    clock.advance(RETIRE_AFTER_S)
    assert topics.retire(in_use=set()) == [f"{BASE}.{n}" for n in range(NAMES - 1)]
    assert topics.wants_next(10) == f"{BASE}.0"
