"""The producers: the partitioner (Kafka's murmur2, with a shortcut for one partition)
and the batch size every producer, the Faust job's too, is given."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner
from pydantic import ValidationError

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


async def test_every_producer_batches_up_to_the_configured_bytes() -> None:
    producer = make_producer(Settings(producer_batch_bytes=65_536))
    assert producer._message_accumulator._batch_size == 65_536
    assert make_producer(Settings())._message_accumulator._batch_size == 262_144


def test_the_faust_job_s_producer_batches_as_much() -> None:
    from stream_jobs.app import faust_app

    assert faust_app(Settings(producer_batch_bytes=65_536)).conf.producer_max_batch_size == 65_536


@pytest.mark.parametrize("size", [0, 16_383, 1_000_001, 2**31])
def test_a_batch_size_kafka_would_refuse_or_aiokafka_cannot_fill_is_invalid(size: int) -> None:
    with pytest.raises(ValidationError, match="producer_batch_bytes"):
        Settings(producer_batch_bytes=size)
