"""A class 2 tenant flooding the stack from a process of its own, as another tenant's
program would: its client's work (producing, reading 50 streams) does not share the
measuring test's event loop. Runs until SIGTERM, then lets its streams finish.

    python -m tests.load.flood TENANT INTERVAL_S MAX_TOKENS
"""

from __future__ import annotations

import asyncio
import signal
import sys

from producers import TokenbusClient
from schemas import InferenceRequest, SamplingParams
from tokenbus.config import Settings


async def flood(tenant: str, interval_s: float, max_tokens: int) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runs: list[asyncio.Task[int]] = []

    async def drain(client: TokenbusClient, request: InferenceRequest) -> int:
        return sum([chunk.num_tokens async for chunk in client.stream(request)])

    async with TokenbusClient(Settings()) as client:
        print("flooding", flush=True)
        while not stop.is_set():
            request = await client.submit(
                tenant_id=tenant,
                prompt="batch work " * 20,
                priority=2,
                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            runs.append(asyncio.create_task(drain(client, request)))
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except TimeoutError:
                pass
        tokens = await asyncio.gather(*runs)
    print(f"{len(runs)} requests, {sum(tokens)} tokens", flush=True)


if __name__ == "__main__":
    asyncio.run(flood(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
