"""``python -m bench.aiokafka_floor_app``: admission's least work without Faust.

A plain aiokafka consumer in a group of its own on the class 1 request topic, and one
producer, as a batched admit path around Faust would have them: each ``getmany`` batch's
records are produced unread to the pretend worker's topic, and the batch's offsets are
committed once the broker has every one of them (what the job's ack-after-forward rule
asks). With ``BENCH_FLOOR_MODE=aiokafka_ledger``, each record also gets one keyed record
on a compacted topic of as many partitions, as a changelog-backed table write sends.

No decoding, checks, quota window, routing or tracing, and none of Faust's per-event
machinery: ``bench.faust_floor`` runs it beside the Faust floors and the job, so the
difference between the two floors is what Faust's stream, its consumer thread and its
table writes cost per request. ``BENCH_FLOOR_TO`` names the worker topic.
"""

from __future__ import annotations

import asyncio
import os

from tokenbus import loops
from tokenbus.config import Settings
from tokenbus.kafka import ensure_topics, make_consumer, make_producer
from tokenbus.topics import Topics

MODES = ("aiokafka_forward", "aiokafka_ledger")


async def forward(settings: Settings, mode: str, forward_to: str, stop: asyncio.Event) -> None:
    if mode not in MODES:
        raise ValueError(f"BENCH_FLOOR_MODE must be one of {MODES}, not {mode!r}")
    ledger = f"{settings.topic_prefix}.floor-ledger"
    if mode == "aiokafka_ledger":
        await ensure_topics(settings, {ledger: settings.num_partitions})
    consumer = make_consumer(
        settings, group_id="bench-aiokafka-floor", enable_auto_commit=False, max_poll_records=2_000
    )
    producer = make_producer(settings)
    await producer.start()
    await consumer.start()
    consumer.subscribe([Topics(settings.topic_prefix).requests(1)])
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=100)
            sent = []
            for tp, records in batches.items():
                for record in records:
                    if mode == "aiokafka_ledger":
                        sent.append(
                            await producer.send(
                                ledger, b"1", key=record.key, partition=tp.partition
                            )
                        )
                    sent.append(await producer.send(forward_to, record.value, key=record.key))
            if sent:
                await asyncio.gather(*sent)
                await consumer.commit()
    finally:
        await consumer.stop()
        await producer.stop()


def main() -> int:
    mode = os.environ.get("BENCH_FLOOR_MODE", "aiokafka_forward")
    forward_to = os.environ["BENCH_FLOOR_TO"]
    loops.run_service(lambda settings, stop: forward(settings, mode, forward_to, stop))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
