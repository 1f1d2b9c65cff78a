"""tokenbus.dlq: a dead letter reports any record, and stays small enough to send."""

from __future__ import annotations

import hashlib

import pytest

from schemas import DeadLetter, decode
from tests.unit.fakes import TOPICS, Recorder
from tokenbus.dlq import MAX_PAYLOAD_BYTES, MAX_TEXT_CHARS, dead_letter

RECORD_LIMIT = 1_000_000
"""A producer's default ``max_request_size``: a dead letter larger is never sent."""


async def letter_of(key: bytes | None, value: bytes | None, reason: str) -> tuple[DeadLetter, int]:
    recorder = Recorder()
    await dead_letter(
        recorder,
        TOPICS,
        consumer="job",
        source_topic="requests",
        partition=3,
        offset=7,
        key=key,
        value=value,
        reason=reason,
    )
    [raw] = recorder.on(TOPICS.dead_letters)
    return decode(DeadLetter, raw), len(raw)


async def test_a_small_record_is_copied_whole() -> None:
    letter, _ = await letter_of(b"acme", b'{"request_id": "r1"}', "invalid: no prompt")
    assert letter.payload == '{"request_id": "r1"}' and not letter.payload_truncated
    assert letter.payload_bytes == 20
    assert letter.payload_sha256 == hashlib.sha256(b'{"request_id": "r1"}').hexdigest()
    assert (letter.key, letter.reason, letter.offset) == ("acme", "invalid: no prompt", 7)


@pytest.mark.parametrize("byte", [b"\x01", b'"', b"\\", b"\xff"])
async def test_a_record_that_json_escapes_sixfold_still_makes_a_letter_to_send(
    byte: bytes,
) -> None:
    value = byte * (RECORD_LIMIT - 100)  # as large as a producer may send
    letter, size = await letter_of(byte * 100_000, value, "refused: " + "x" * 500_000)
    assert size < RECORD_LIMIT
    assert letter.payload_truncated and letter.payload_bytes == len(value)
    assert letter.payload_sha256 == hashlib.sha256(value).hexdigest()
    assert letter.payload == value[:MAX_PAYLOAD_BYTES].decode("utf-8", "replace")
    assert letter.reason.startswith("refused: xxx") and len(letter.reason) < MAX_TEXT_CHARS + 50
    assert letter.key is not None and len(letter.key) < MAX_TEXT_CHARS + 50


async def test_no_value_is_an_empty_payload() -> None:
    letter, _ = await letter_of(None, None, "tombstone")
    assert (letter.payload, letter.payload_bytes, letter.key) == ("", 0, None)
