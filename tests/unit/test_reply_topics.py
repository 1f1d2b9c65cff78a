from __future__ import annotations

from producers.reply_topics import RETIRE_AFTER_S, ReplyTopics
from tests.unit.fakes import ManualClock

BASE = "tb.replies.c1"


def test_without_rolling_a_client_has_one_topic_named_exactly() -> None:
    topics = ReplyTopics(BASE, None)
    assert not topics.rolls
    assert topics.current == BASE and topics.prefix == BASE
    assert topics.wants_next(10**9) is None
    assert not topics.switch(10**9)
    assert topics.read == [BASE] == topics.owned


def test_the_next_topic_is_made_at_half_and_taken_when_full() -> None:
    clock = ManualClock()
    topics = ReplyTopics(BASE, 100, clock=clock)
    assert topics.rolls
    assert topics.current == f"{BASE}.0" and topics.prefix == f"{BASE}."
    assert topics.wants_next(49) is None
    assert topics.wants_next(50) == f"{BASE}.1"
    assert topics.wants_next(60) is None  # asked once
    assert not topics.switch(100)  # full, but the next one is not there yet
    topics.ready(f"{BASE}.1")
    assert topics.owned == [f"{BASE}.0", f"{BASE}.1"]
    assert not topics.switch(99)
    assert topics.switch(100)
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
    topics.ready(topics.wants_next(5) or "")
    assert topics.switch(10)
    old = f"{BASE}.0"
    clock.advance(RETIRE_AFTER_S - 1)
    assert topics.retire(set) == []  # answers after a stream's end may come
    clock.advance(2)
    assert topics.retire(lambda: {old}) == []  # a stream still reads it
    assert topics.retire(lambda: {f"{BASE}.1"}) == [old]
    assert topics.read == [f"{BASE}.1"]
    assert topics.retire(set) == []  # once


def test_a_deleted_topic_is_deleted_once_more_when_producers_let_it_go() -> None:
    clock = ManualClock()
    topics = ReplyTopics(BASE, 10, clock=clock, delete_again_after_s=21)
    topics.ready(topics.wants_next(5) or "")
    assert topics.switch(10)
    old = f"{BASE}.0"
    clock.advance(RETIRE_AFTER_S)
    assert topics.retire(set) == [old]
    assert old in topics.owned  # a close deletes it again too
    clock.advance(20)
    assert topics.delete_again() == []  # a producer may still ask about it
    clock.advance(1)
    assert topics.delete_again() == [old]
    assert topics.delete_again() == []  # once
    assert old not in topics.owned
