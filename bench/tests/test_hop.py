import time

from bench.hop_producer import sent_at_ns, stamp


def test_a_stamp_carries_the_shared_clock_at_its_send() -> None:
    before = time.monotonic_ns()
    value = stamp()
    sent = sent_at_ns(value)
    assert sent is not None
    assert before <= sent <= time.monotonic_ns()


def test_records_that_are_not_stamps_are_not_timed() -> None:
    for value in (b"first", b"7", b"t", b"t12x", b"", b"x123"):
        assert sent_at_ns(value) is None
