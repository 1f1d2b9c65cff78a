from __future__ import annotations

from workers.cancels import CancelBook


def test_a_noted_cancel_matches_its_tenant_and_request_only() -> None:
    book = CancelBook()
    book.note("tenant-a", "req_1", now=0.0)
    assert book.is_cancelled("tenant-a", "req_1", now=1.0)
    assert not book.is_cancelled("tenant-b", "req_1", now=1.0)
    assert not book.is_cancelled("tenant-a", "req_2", now=1.0)


def test_cancels_expire_after_ttl() -> None:
    book = CancelBook(ttl_s=10.0)
    book.note("t", "req_1", now=0.0)
    assert book.is_cancelled("t", "req_1", now=9.9)
    assert not book.is_cancelled("t", "req_1", now=10.0)
    book.note("t", "req_2", now=20.0)  # noting expires old entries
    assert len(book) == 1


def test_book_is_bounded_and_drops_the_oldest() -> None:
    book = CancelBook(max_entries=2)
    for i in range(3):
        book.note("t", f"req_{i}", now=float(i))
    assert len(book) == 2
    assert not book.is_cancelled("t", "req_0", now=3.0)
    assert book.is_cancelled("t", "req_2", now=3.0)


def test_a_cancel_of_one_attempt_leaves_the_next_alone() -> None:
    book = CancelBook()
    book.note("t", "req_1", now=0.0, attempt=0, reason="reassigned")
    assert book.reason("t", "req_1", 0, now=1.0) == "reassigned"
    assert book.reason("t", "req_1", 1, now=1.0) is None
    book.note("t", "req_1", now=2.0)  # the client's: every attempt
    assert book.reason("t", "req_1", 1, now=3.0) == "client_cancelled"
