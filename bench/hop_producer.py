"""The producer side of ``bench.hop``'s hop, in a process of its own as every producer
of tokenbus is, and paced by its own clock, never by the consumer's reads: each record
reaches a consumer that is waiting in a parked fetch, as a request's records do.

It reads its settings from ``TOKENBUS_*`` (as every service does), waits for one line
on stdin (and sends nothing if stdin closes first), then sends ``--messages`` records to
partition 0 of ``--topic``, each after a random pause around ``--pause-ms``; a record's
value is ``t<CLOCK_MONOTONIC ns>`` taken just before it is sent, a clock every process
on the machine shares.

    .venvs/stream/bin/python -m bench.hop_producer --topic bench.hop --messages 100
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from tokenbus.config import Settings
from tokenbus.kafka import make_producer


def stamp() -> bytes:
    return b"t%d" % time.monotonic_ns()


def sent_at_ns(value: bytes) -> int | None:
    """The send time a record of this producer carries, or None for any other record."""
    if not value.startswith(b"t") or not value[1:].isdigit():
        return None
    return int(value[1:])


async def produce(topic: str, messages: int, pause_ms: float) -> None:
    producer = make_producer(Settings())
    await producer.start()
    try:
        if not await asyncio.to_thread(sys.stdin.readline):
            return  # stdin closed before the go line: the consumer's process is gone
        for _ in range(messages):
            await asyncio.sleep(pause_ms / 1000 * (0.5 + random.random()))
            await producer.send_and_wait(topic, stamp(), partition=0)
    finally:
        await producer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--messages", type=int, required=True)
    parser.add_argument("--pause-ms", type=float, default=50.0)
    args = parser.parse_args()
    asyncio.run(produce(args.topic, args.messages, args.pause_ms))


if __name__ == "__main__":
    main()
