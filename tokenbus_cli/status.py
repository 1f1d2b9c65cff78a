"""``tokenbus status``: the health of each service a local stack wrote down."""

from __future__ import annotations

import asyncio

from tokenbus.config import Settings
from tokenbus_cli.stack_state import ServiceRecord, StackState

HEARTBEAT_WINDOW_S = 2.0
"""How long status listens for worker heartbeats (they come every 0.5 s)."""


async def service_health(settings: Settings, state: StackState) -> dict[str, str]:
    """``ok ...`` or what is wrong, per service name."""
    settings = settings.model_copy(
        update={"kafka_bootstrap": state.bootstrap, "broker_profile": state.broker_profile}
    )
    beats = (
        await _heartbeats(settings)
        if any(s.health == "heartbeat" and s.alive() for s in state.services)
        else {}
    )
    return {s.name: await _health(settings, s, beats) for s in state.services}


async def _health(settings: Settings, service: ServiceRecord, beats: dict[str, float]) -> str:
    if not service.alive():
        return "not running"
    if service.health == "http":
        from tokenbus_cli.stack import http_ok

        url = f"http://127.0.0.1:{service.port}/healthz"
        return "ok" if await asyncio.to_thread(http_ok, url) else "running, /healthz not ok"
    if service.health == "kafka":
        from tokenbus.kafka import wait_for_broker

        try:
            await wait_for_broker(settings, timeout_s=3)
        except Exception:  # any failure means the broker does not answer
            return "running, not answering"
        return "ok"
    if service.health == "heartbeat":
        if service.name in beats:
            return f"ok, heartbeat {beats[service.name]:.1f} s ago"
        return f"running, no heartbeat in {HEARTBEAT_WINDOW_S:.0f} s"
    return "ok (running)"


async def _heartbeats(settings: Settings) -> dict[str, float]:
    """Worker id -> seconds since its newest heartbeat, heard within the window."""
    import time

    from aiokafka import TopicPartition
    from aiokafka.errors import KafkaError

    from tokenbus.kafka import make_consumer
    from tokenbus.topics import Topics

    seen: dict[str, float] = {}
    consumer = make_consumer(settings, group_id=None, auto_offset_reset="latest")
    try:
        await consumer.start()
        tp = TopicPartition(Topics(settings.topic_prefix).heartbeats, 0)
        consumer.assign([tp])
        deadline = time.monotonic() + HEARTBEAT_WINDOW_S
        while time.monotonic() < deadline:
            batches = await consumer.getmany(tp, timeout_ms=200)
            for record in batches.get(tp, []):
                if record.key:
                    seen[record.key.decode()] = record.timestamp / 1000
    except KafkaError:
        return {}
    finally:
        await consumer.stop()
    now = time.time()
    return {worker: max(0.0, now - at) for worker, at in seen.items()}
