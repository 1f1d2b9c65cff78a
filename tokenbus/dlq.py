"""The dead-letter path: a message that does not parse is parked with its reason.

It is never silently dropped and it never stops a consumer: the consumer sends the
original bytes here, then carries on (and commits past it) as if it had been handled.
"""

from __future__ import annotations

import logging
from typing import Any

from schemas import DeadLetter, encode
from tokenbus.kafka import Publish
from tokenbus.topics import Topics

log = logging.getLogger(__name__)


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
    letter = DeadLetter(
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        consumer=consumer,
        reason=reason,
        key=key.decode("utf-8", "replace") if key is not None else None,
        payload=(value or b"").decode("utf-8", "replace"),
    )
    log.warning("dead letter from %s[%d]@%d: %s", source_topic, partition, offset, reason)
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
