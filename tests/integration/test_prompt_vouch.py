"""The bridge counts each prompt once, for its own checks, and vouches for that count on
the request record; the job takes it from there instead of counting again
(``tokenbus.prompt_vouch``). On the real stack: the count on the record is the job's own
rule's count for that record, and the engine's count of what it ran."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from aiokafka import TopicPartition

from schemas import InferenceRequest
from schemas.codec import decode
from stream_jobs.prompt_tokens import PromptCounter
from tests.integration.conftest import BridgeProcess, bridge_key, eventually
from tests.integration.test_quotas import job_metrics
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus.prompt_vouch import HEADER, vouched
from tokenbus.topics import Topics

MODEL = "tiny-llama"
VOUCHED = "tokenbus_job_num_prompt_counts_vouched_total"


async def test_the_bridge_vouches_for_the_count_the_job_and_the_engine_would_make(
    bridge: BridgeProcess, settings: Settings
) -> None:
    secret = settings.bus_service_secret
    assert secret
    topics = Topics(settings.topic_prefix)
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        names = topics.all_requests
        tps = [TopicPartition(t, p) for t in names for p in consumer.partitions_for_topic(t) or {0}]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)
        before = job_metrics(settings).get(VOUCHED, 0.0)

        headers = {"Authorization": f"Bearer {bridge_key('br-alice')}"}
        bodies: list[tuple[str, dict[str, Any]]] = [
            (
                "/v1/chat/completions",
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "developer", "content": "Answer in one word."},
                        {"role": "user", "content": "The ﬁrst café, Ⅸ ① and a tab\there?"},
                    ],
                    "max_tokens": 2,
                },
            ),
            (
                "/v1/completions",
                {"model": MODEL, "prompt": "ﬁne  spaces\n\nand \uff12 lines", "max_tokens": 2},
            ),
        ]
        async with httpx.AsyncClient(base_url=bridge.url, timeout=120) as http:
            answers = await asyncio.gather(
                *(http.post(path, json=body, headers=headers) for path, body in bodies)
            )
        for answer in answers:
            assert answer.status_code == 200, answer.text
        engine_counts = {
            a.headers["x-request-id"]: a.json()["usage"]["prompt_tokens"] for a in answers
        }

        records: dict[str, Any] = {}
        deadline = time.monotonic() + 30
        while len(records) < len(bodies):
            assert time.monotonic() < deadline, f"request records not read: {sorted(records)}"
            fetched = await consumer.getmany(timeout_ms=1_000)
            for batch in fetched.values():
                for record in batch:
                    request = decode(InferenceRequest, record.value)
                    if request.request_id in engine_counts:
                        records[request.request_id] = (request, record)
    finally:
        await consumer.stop()

    counter = PromptCounter(settings.model_dir / "tokenizer.json")
    for request_id, (request, record) in records.items():
        vouch = dict(record.headers).get(HEADER)
        count = vouched(secret, record.value, vouch)
        assert count is not None, record.headers
        assert count == counter.count(request) == engine_counts[request_id], request
    await eventually(
        lambda: job_metrics(settings).get(VOUCHED, 0.0), until=lambda n: n >= before + len(bodies)
    )
