"""The batch commands topic, ``<prefix>.batches``: ``BatchCommand``s keyed
``<tenant>/<batch_id>``, so a batch's create and cancel share a partition (and so one
runner). Only tokenbus's services write it, after checking the tenant."""

from __future__ import annotations

from typing import Literal

from aiokafka import AIOKafkaProducer

from schemas import encode
from schemas.batches import BatchCommand
from tokenbus.config import Settings
from tokenbus.topics import Topics


def command_key(tenant_id: str, batch_id: str) -> bytes:
    return f"{tenant_id}/{batch_id}".encode()


async def send_command(
    producer: AIOKafkaProducer,
    settings: Settings,
    kind: Literal["create", "cancel"],
    tenant: str,
    batch_id: str,
) -> None:
    command = BatchCommand(kind=kind, tenant_id=tenant, batch_id=batch_id)
    await producer.send_and_wait(
        Topics(settings.topic_prefix).batches, encode(command), key=command_key(tenant, batch_id)
    )
