"""A tenant sending over its quota from a process of its own, as an abusive program
would: requests at a fixed rate for a while, each stream read to its end. Its reads
do not share an event loop (or a core's queue) with the clients whose latency the
chaos matrix measures. Writes every request's chunks to OUT, one request a JSON line, after a
first line with the wall-clock start and end of its sending.

Takes the stack's settings from ``TOKENBUS_*`` (the service secret among them).

    python -m tests.load.abuser TENANT SECONDS REQUESTS_PER_S MAX_TOKENS OUT
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import orjson

from producers import TokenbusClient
from schemas import InferenceRequest, SamplingParams
from tokenbus.chunks import Chunk, to_model
from tokenbus.config import Settings


async def abuse(tenant: str, seconds: float, per_second: float, max_tokens: int, out: Path) -> None:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async with TokenbusClient(Settings()) as client:

        async def run(request: InferenceRequest) -> tuple[str, list[Chunk]]:
            return request.request_id, [chunk async for chunk in client.stream(request)]

        tasks: list[asyncio.Task[tuple[str, list[Chunk]]]] = []
        began, began_wall = time.monotonic(), time.time()
        i = 0
        while time.monotonic() - began < seconds:
            request = await client.submit(tenant_id=tenant, prompt="x", sampling=sampling)
            tasks.append(asyncio.create_task(run(request)))
            i += 1
            await asyncio.sleep(max(0.0, began + i / per_second - time.monotonic()))
        ended_wall = time.time()
        results = await asyncio.gather(*tasks)
    with out.open("wb") as file:
        file.write(orjson.dumps({"began": began_wall, "ended": ended_wall}) + b"\n")
        for request_id, chunks in results:
            line = {
                "request_id": request_id,
                "chunks": [to_model(c).model_dump(mode="json") for c in chunks],
            }
            file.write(orjson.dumps(line) + b"\n")
    print(f"{len(results)} requests", flush=True)


if __name__ == "__main__":
    tenant, seconds, rate, max_tokens, out = sys.argv[1:6]
    asyncio.run(abuse(tenant, float(seconds), float(rate), int(max_tokens), Path(out)))
