"""A prompt count vouched for on a request record: the MAC binds count and value."""

from __future__ import annotations

import pytest

from tokenbus.prompt_vouch import MAX_COUNT, vouch, vouched

SECRET = "unit-test-bus-service-secret-0123456789"
VALUE = b'{"request_id":"r1","prompt":"hello"}'


def test_a_vouch_gives_its_count_back_for_its_own_value() -> None:
    for count in (0, 1, 57, MAX_COUNT):
        assert vouched(SECRET, VALUE, vouch(SECRET, VALUE, count)) == count


def test_a_vouch_is_for_one_value_one_count_and_one_secret() -> None:
    header = vouch(SECRET, VALUE, 57)
    assert vouched(SECRET, VALUE + b" ", header) is None  # another record's value
    assert vouched(SECRET + "x", VALUE, header) is None  # not the bus's secret
    mac = header.partition(b".")[2]
    assert vouched(SECRET, VALUE, b"5." + mac) is None  # the count changed
    assert vouched(SECRET, VALUE, b"057." + mac) is None  # the same count, spelt otherwise


@pytest.mark.parametrize(
    "header",
    [
        None,
        b"",
        b"57",
        b"57.",
        b".abc",
        b"-1.abc",
        b"+57.abc",
        b" 57.abc",
        "\uff15\uff17.abc".encode(),  # full-width digits
        b"99999999999.abc",
        b"57." + b"A" * 100,
    ],
)
def test_a_malformed_vouch_vouches_for_nothing(header: bytes | None) -> None:
    assert vouched(SECRET, VALUE, header) is None


@pytest.mark.parametrize("count", [-1, MAX_COUNT + 1])
def test_a_count_out_of_range_is_not_vouched_for(count: int) -> None:
    with pytest.raises(ValueError, match="prompt count"):
        vouch(SECRET, VALUE, count)
