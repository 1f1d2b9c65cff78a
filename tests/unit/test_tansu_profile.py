"""The broker profile is the one switch for the bundled broker's workarounds: ``kafka``
(the default) installs no patch and makes idempotent producers; ``tansu`` installs them
all. And on Kafka, offset gaps that transaction markers leave never stall a consumer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka.consumer import fetcher
from faust.transport.drivers import aiokafka as faust_aiokafka
from pydantic import ValidationError

from stream_jobs.app import create_app
from tests.unit.tansu_records import batch, partition_records
from tokenbus import tansu
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer, make_producer


def patched_methods() -> dict[str, Any]:
    return {
        "PartitionRecords._unpack_records": fetcher.PartitionRecords._unpack_records,
        "Fetcher._proc_fetch_request": fetcher.Fetcher._proc_fetch_request,
        "AIOKafkaConsumerThread._create_worker_consumer": (
            faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer
        ),
    }


@pytest.fixture
def as_shipped() -> Iterator[dict[str, Any]]:
    """aiokafka and Faust as they ship, before and after the test."""
    tansu.uninstall()
    yield patched_methods()
    tansu.uninstall()


def test_kafka_is_the_default_profile() -> None:
    settings = Settings()
    assert settings.broker_profile == "kafka"
    assert settings.idempotent_producers
    assert settings.kafka_acks == "all"


async def test_the_kafka_profile_installs_no_patch(
    as_shipped: dict[str, Any], tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path)
    consumer = make_consumer(settings, "tokenbus.usage", group_id=None)
    create_app(settings)
    assert patched_methods() == as_shipped
    assert consumer._fetch_max_wait_ms == settings.consumer_fetch_wait_ms == 500


async def test_background_consumers_wait_longer_on_the_bundled_broker_only(
    as_shipped: dict[str, Any],
) -> None:
    def waits(settings: Settings) -> tuple[int, int]:
        request_path = make_consumer(settings, "tokenbus.replies", group_id=None)
        background = make_consumer(settings, "tokenbus.usage", group_id=None, background=True)
        return request_path._fetch_max_wait_ms, background._fetch_max_wait_ms

    assert waits(Settings()) == (500, 500)  # Kafka answers a parked fetch at once
    assert waits(Settings(broker_profile="tansu")) == (20, 100)
    assert waits(Settings(broker_profile="tansu", background_fetch_max_wait_ms=250)) == (20, 250)
    # Never below the request path's wait, whatever is set.
    assert waits(Settings(broker_profile="tansu", fetch_max_wait_ms=300)) == (300, 300)
    assert waits(Settings(fetch_max_wait_ms=50, background_fetch_max_wait_ms=10)) == (50, 50)


def test_a_fetch_wait_below_its_floor_is_refused_with_the_setting_named() -> None:
    # tansu never answers a fetch parked at 0 ms: the job's wait (tansu only) is 1 or
    # more; the others may be 0 (Apache Kafka then answers at once), never negative.
    for field, value in (
        ("job_fetch_max_wait_ms", 0),
        ("fetch_max_wait_ms", -1),
        ("background_fetch_max_wait_ms", -5),
    ):
        with pytest.raises(ValidationError, match=field):
            Settings.model_validate({field: value})
    assert Settings(fetch_max_wait_ms=0).consumer_fetch_wait_ms == 0
    assert Settings(job_fetch_max_wait_ms=1).job_fetch_max_wait_ms == 1


async def test_the_kafka_profile_makes_idempotent_producers_with_acks_all() -> None:
    producer = make_producer(Settings())
    assert producer._txn_manager is not None  # aiokafka's idempotence machinery
    assert producer._sender._acks == -1  # all
    tansu_producer = make_producer(Settings(broker_profile="tansu"))
    assert tansu_producer._txn_manager is None  # tansu has no InitProducerId


async def test_the_tansu_profile_installs_every_workaround(
    as_shipped: dict[str, Any], tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path, broker_profile="tansu")
    make_consumer(settings, "tokenbus.usage", group_id=None)
    create_app(settings)
    installed = patched_methods()
    assert all(installed[name] is not as_shipped[name] for name in as_shipped), installed


def test_a_tansu_workaround_set_to_zero_is_off(as_shipped: dict[str, Any]) -> None:
    settings = Settings(broker_profile="tansu", kafka_gap_settle_s=0, fetch_max_wait_cap_ms=0)
    tansu.install_for_consumers(settings)
    assert (
        fetcher.PartitionRecords._unpack_records is as_shipped["PartitionRecords._unpack_records"]
    )


@pytest.mark.parametrize("profile", ["kafka", "tansu"])
async def test_gaps_from_transaction_markers_never_stall_a_consumer(
    as_shipped: dict[str, Any], profile: str
) -> None:
    """A transactional producer writing a tokenbus topic leaves commit markers in it:
    offsets no record holds. aiokafka skips them; the consumer reads on at once."""
    settings = Settings(broker_profile=profile)  # type: ignore[arg-type]
    make_consumer(settings, "tokenbus.usage", group_id=None)
    markers = [batch(2, 1, control=True), batch(5, 1, control=True)]
    records = partition_records(
        "tokenbus.usage", 0, batch(0, 2), markers[0], batch(3, 2), markers[1], batch(6, 1)
    )
    assert [record.offset for record in records] == [0, 1, 3, 4, 6]
    assert records.next_fetch_offset == 7  # the next fetch goes on from the end


async def test_the_faust_consumer_expects_records_after_a_quiet_spell(
    monkeypatch: pytest.MonkeyPatch, as_shipped: dict[str, Any]
) -> None:
    """A usage record after a quiet spell ends a request, and a program's next one
    follows: the job's consumer (and no other) fetches briefly for it."""
    from aiokafka import AIOKafkaConsumer

    from tokenbus.tansu import fetch_wait

    made: list[AIOKafkaConsumer] = []

    def create(thread: Any, transport: Any) -> AIOKafkaConsumer:  # Faust's, as it ships
        made.append(AIOKafkaConsumer(fetch_max_wait_ms=1500))
        return made[-1]

    monkeypatch.setattr(faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer", create)
    tansu.install_for_faust(Settings(broker_profile="tansu", job_fetch_max_wait_ms=20))
    unused: Any = None  # the thread and transport, which the stand-in ignores
    consumer = faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer(unused, unused)
    other = make_consumer(Settings(broker_profile="tansu"), group_id=None)
    assert consumer is made[0] and consumer._fetch_max_wait_ms == 20
    assert consumer._subscription in fetch_wait._after_quiet
    assert other._subscription not in fetch_wait._after_quiet
