"""A tenant sending from a process of its own, as an abusive program would: requests
at a fixed rate, each stream read to its end, the rate changed by the caller while it
runs. Its reads do not share an event loop (or a core's queue) with the clients whose
latency the chaos matrix measures.

Starts at REQUESTS_PER_S and prints ``sending`` once its client is up. Each line on
stdin is a new rate (requests a second); end of stdin stops the sending. Then it waits
for every stream to end and writes OUT: a first line with the wall-clock times of its
rates (``phases``: [start, rate] pairs) and of its last send (``ended``), then every
request's chunks, one request a JSON line.

Takes the stack's settings from ``TOKENBUS_*`` (the service secret among them).

    python -m tests.load.abuser TENANT REQUESTS_PER_S MAX_TOKENS OUT
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


async def _rates(phases: list[list[float]], changed: asyncio.Event, done: asyncio.Event) -> None:
    """Reads stdin: each line a new rate, appended to ``phases``; end of input ends it."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        phases.append([time.time(), float(line)])
        changed.set()
    done.set()
    changed.set()


async def abuse(tenant: str, per_second: float, max_tokens: int, out: Path) -> None:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async with TokenbusClient(Settings()) as client:

        async def run(request: InferenceRequest) -> tuple[str, list[Chunk]]:
            return request.request_id, [chunk async for chunk in client.stream(request)]

        tasks: list[asyncio.Task[tuple[str, list[Chunk]]]] = []
        phases = [[time.time(), per_second]]
        changed, done = asyncio.Event(), asyncio.Event()
        reading = asyncio.create_task(_rates(phases, changed, done))
        print("sending", flush=True)
        due = time.monotonic()
        while not done.is_set():
            request = await client.submit(tenant_id=tenant, prompt="x", sampling=sampling)
            tasks.append(asyncio.create_task(run(request)))
            rate = phases[-1][1]
            due += 1 / rate
            changed.clear()
            with_change = asyncio.create_task(changed.wait())
            await asyncio.wait([with_change], timeout=max(0.0, due - time.monotonic()))
            with_change.cancel()
            if phases[-1][1] != rate:  # a new rate: its first request now
                due = time.monotonic()
        ended_wall = time.time()
        await reading
        results = await asyncio.gather(*tasks)
    with out.open("wb") as file:
        file.write(orjson.dumps({"phases": phases, "ended": ended_wall}) + b"\n")
        for request_id, chunks in results:
            line = {
                "request_id": request_id,
                "chunks": [to_model(c).model_dump(mode="json") for c in chunks],
            }
            file.write(orjson.dumps(line) + b"\n")
    print(f"{len(results)} requests", flush=True)


if __name__ == "__main__":
    tenant, rate, max_tokens, out = sys.argv[1:5]
    asyncio.run(abuse(tenant, float(rate), int(max_tokens), Path(out)))
