"""Fetched record batches as a broker sends them, built in memory for fetcher tests."""

from __future__ import annotations

import struct

from aiokafka import TopicPartition
from aiokafka.consumer.fetcher import PartitionRecords
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import ConsumerRecord

ATTRIBUTES_AT = struct.calcsize(">qiibI")
PRODUCER_AT = struct.calcsize(">qiibIhiqq")
TRANSACTIONAL, CONTROL = 0x10, 0x20
COMMIT_MARKER = struct.pack(">hh", 0, 1)  # control record key: version 0, type commit


def batch(base_offset: int, num_records: int, *, control: bool = False) -> bytes:
    """``num_records`` records from ``base_offset``; ``control``: one commit marker, as
    a transactional producer's commit leaves in the log."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=int(control),
        producer_id=7 if control else -1,
        producer_epoch=0 if control else -1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    for n in range(num_records):
        key = COMMIT_MARKER if control else None
        value = b"\0\0\0\0\0\0" if control else str(base_offset + n).encode()
        builder.append(n, timestamp=1_000, key=key, value=value, headers=[])
    buffer = builder.build()
    struct.pack_into(">q", buffer, 0, base_offset)
    if control:
        (attributes,) = struct.unpack_from(">h", buffer, ATTRIBUTES_AT)
        struct.pack_into(">h", buffer, ATTRIBUTES_AT, attributes | TRANSACTIONAL | CONTROL)
    return bytes(buffer)


def partition_records(topic: str, fetch_offset: int, *batches: bytes) -> PartitionRecords:
    """What aiokafka's fetcher makes of one partition's fetch response (read uncommitted)."""
    return PartitionRecords(
        TopicPartition(topic, 0),
        MemoryRecords(b"".join(batches)),
        [],
        fetch_offset,
        None,
        None,
        False,  # no CRC check: the control batch's attributes were changed after build
        0,
    )


def offsets(records: PartitionRecords) -> list[int]:
    out: list[int] = []
    for record in records:
        assert isinstance(record, ConsumerRecord)
        out.append(record.offset)
    return out
