"""The dead-letter path: a message that does not parse is parked with its reason.

It is never silently dropped and it never stops a consumer: the consumer sends the
original bytes here, then carries on (and commits past it) as if it had been handled.

A dead letter stays well under a record's 1 MB limit, whatever it reports: its payload
is the first ``MAX_PAYLOAD_BYTES`` of the value (JSON may escape a byte into six), with
the whole value's length and SHA-256; the source record at ``partition``/``offset`` is
the whole of it. The key and the reason are cut likewise. A producer cannot make its
record's dead letter too large to send, and so lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from schemas import DeadLetter, encode
from tokenbus.kafka import Publish
from tokenbus.retry import Backoff, until_done
from tokenbus.topics import Topics

log = logging.getLogger(__name__)

MAX_PAYLOAD_BYTES = 64 * 1024
"""The most of a value a dead letter copies."""
MAX_TEXT_CHARS = 4096
"""The most of a key or a reason a dead letter copies."""


def _cut(text: str) -> str:
    if len(text) <= MAX_TEXT_CHARS:
        return text
    return f"{text[:MAX_TEXT_CHARS]}... ({len(text) - MAX_TEXT_CHARS} more characters)"


async def dead_letter(
    publish: Publish,
    topics: Topics,
    *,
    consumer: str,
    source_topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    reason: str,
) -> None:
    value = value or b""
    reason = _cut(reason)
    letter = DeadLetter(
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        consumer=consumer,
        reason=reason,
        key=_cut(key.decode("utf-8", "replace")) if key is not None else None,
        payload=value[:MAX_PAYLOAD_BYTES].decode("utf-8", "replace"),
        payload_bytes=len(value),
        payload_sha256=hashlib.sha256(value).hexdigest(),
        payload_truncated=len(value) > MAX_PAYLOAD_BYTES,
    )
    log.warning("dead letter from %s[%d]@%d: %s", source_topic, partition, offset, reason[:500])
    await publish(topics.dead_letters, (key or b""), encode(letter))


async def dead_letter_record(
    publish: Publish, topics: Topics, record: Any, *, consumer: str, reason: str
) -> None:
    """``dead_letter`` for an aiokafka ConsumerRecord (anything with its five fields)."""
    await dead_letter(
        publish,
        topics,
        consumer=consumer,
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key,
        value=record.value,
        reason=reason,
    )


async def dead_letter_until_sent(
    publish: Publish,
    topics: Topics,
    record: Any,
    *,
    consumer: str,
    reason: str,
    stop: asyncio.Event,
    backoff: Backoff,
    on_failure: Callable[[], None] | None = None,
) -> bool:
    """``dead_letter_record``, retried with ``backoff`` until the broker has it; False if
    ``stop`` was set meanwhile (the caller then commits nothing, so the record comes
    again, and is dead-lettered then)."""

    async def send() -> None:
        await dead_letter_record(publish, topics, record, consumer=consumer, reason=reason)

    what = f"dead letter of {record.topic}[{record.partition}]@{record.offset}"
    return await until_done(send, stop, backoff, what, on_failure)
