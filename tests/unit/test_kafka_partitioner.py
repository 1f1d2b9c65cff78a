"""The producers' partitioner: Kafka's murmur2, with a shortcut for one partition."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner

from tokenbus.config import Settings
from tokenbus.kafka import make_producer, partition_by_key


@pytest.mark.parametrize("key", [b"tenant-a", b"t", b"", None])
def test_a_topic_of_one_partition_gets_that_partition(key: bytes | None) -> None:
    assert partition_by_key(key, [0], [0]) == 0
    assert partition_by_key(key, [3], []) == 3


@pytest.mark.parametrize("key", [b"tenant-a", b"tenant-b", b"x" * 100, b"\xff\x00"])
def test_a_topic_of_many_partitions_is_partitioned_as_kafka_does(key: bytes) -> None:
    partitions = list(range(12))
    assert partition_by_key(key, partitions, partitions) == DefaultPartitioner()(
        key, partitions, partitions
    )


async def test_every_producer_uses_it() -> None:
    producer = make_producer(Settings())
    assert producer._partitioner is partition_by_key
