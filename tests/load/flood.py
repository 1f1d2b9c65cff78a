"""A class 2 tenant flooding the stack from a process of its own, as another tenant's
batch program would: it produces requests and does not read their replies (a reader of
50 streams would take the cores of this 2-core machine from the system under test; on
a fleet it runs elsewhere). Runs until SIGTERM.

It holds the stack's service secret (``TOKENBUS_BUS_SERVICE_SECRET``, as the load tests
pass the stack's settings), and signs its requests with a service token for the tenant
that owns its reply topic.

    python -m tests.load.flood TENANT INTERVAL_S MAX_TOKENS
"""

from __future__ import annotations

import asyncio
import signal
import sys

from schemas import InferenceRequest, SamplingParams, encode
from tokenbus.auth import ServiceTokens
from tokenbus.config import Settings
from tokenbus.ids import new_request_id, new_session_id, ulid
from tokenbus.kafka import ensure_topics, make_producer
from tokenbus.topics import Topics


async def flood(tenant: str, interval_s: float, max_tokens: int) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    settings = Settings()
    if not settings.bus_service_secret:
        raise SystemExit("flood needs the stack's TOKENBUS_BUS_SERVICE_SECRET")
    topics = Topics(settings.topic_prefix)
    # A reply topic of the tenant's own (every credential of the tenant owns it).
    reply_to = topics.replies(f"{tenant}.flood-{ulid().lower()}")
    tokens = ServiceTokens(settings.bus_service_secret)  # renewed at half their life
    await ensure_topics(settings, {reply_to: 1})
    producer = make_producer(settings)
    await producer.start()
    sent = 0
    try:
        print("flooding", flush=True)
        while not stop.is_set():
            request = InferenceRequest(
                request_id=new_request_id(),
                session_id=new_session_id(),
                tenant_id=tenant,
                priority=2,
                model=settings.served_model_name,
                prompt="batch work " * 20,
                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                reply_to=reply_to,
            )
            token = tokens.token(tenant, reply_to)
            await producer.send_and_wait(
                topics.requests(2),
                encode(request),
                key=tenant.encode(),
                headers=[("authorization", f"Bearer {token}".encode())],
            )
            sent += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except TimeoutError:
                pass
    finally:
        # The reply topic stays: the requests admitted so far still run, and their
        # workers write to it (it goes with the stack).
        await producer.stop()
    print(f"{sent} requests", flush=True)


if __name__ == "__main__":
    asyncio.run(flood(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
