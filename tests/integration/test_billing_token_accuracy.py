"""Billed tokens equal the engine's, per request, for short and 8k+ prompts on the real stack.

Three counts must agree for every request: the prompt tokens of the model's own
tokenizer (``tokenizer.json``, which adds the ``<s>`` the engine adds), the tokens the
client received in its chunks, and the counts the worker reported from vLLM in the
request's UsageEvent. ClickHouse must hold exactly those, once, priced by the cost rule.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from billing.reader import open_reader
from producers import TokenbusClient
from schemas import InferenceRequest, SamplingParams, UsageEvent, decode
from tests.integration.conftest import eventually
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus.cost import PeakHours, cost_weight
from tokenbus.kafka import make_consumer
from tokenbus.price_file import load_price_book
from tokenbus.pricing import Pricer
from tokenbus.topics import Topics

pytestmark = pytest.mark.integration

SHORT_PROMPTS = (50, 96, 180, 260, 390, 490)
LONG_PROMPTS = (8_200, 9_600, 12_500)
WORDS = (
    "kafka partition tenant token billing quota worker engine prompt cache session "
    "latency batch priority offset commit replica broker stream schema usage cost "
    "throughput context window minute request reply chunk decode insert rollup"
).split()


def _prompt(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Random words whose encoding (``<s>`` included) has ``num_tokens`` tokens or just more."""
    words = [rng.choice(WORDS) for _ in range(num_tokens)]  # a word is at least one token

    def count(n: int) -> int:
        return len(tokenizer.encode(" ".join(words[:n])).ids)

    low, high = 1, len(words)
    while low < high:  # the fewest words reaching num_tokens
        middle = (low + high) // 2
        if count(middle) >= num_tokens:
            high = middle
        else:
            low = middle + 1
    return " ".join(words[:low])


async def _collect(client: TokenbusClient, request: InferenceRequest) -> list[Chunk]:
    return [chunk async for chunk in client.stream(request)]


async def _usage_events(settings: Settings, request_ids: set[str]) -> dict[str, UsageEvent]:
    """The UsageEvents the worker produced for these requests, read from the topic."""
    consumer = make_consumer(settings, Topics(settings.topic_prefix).usage, group_id=None)
    await consumer.start()
    found: dict[str, UsageEvent] = {}
    deadline = time.monotonic() + 60
    try:
        while set(found) != request_ids and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    event = decode(UsageEvent, record.value)
                    if event.request_id in request_ids:
                        assert event.request_id not in found, "two UsageEvents for one request"
                        found[event.request_id] = event
    finally:
        await consumer.stop()
    return found


async def test_billed_tokens_equal_the_engines_for_short_and_long_prompts(
    client: TokenbusClient, settings: Settings
) -> None:
    tokenizer = Tokenizer.from_file(str(Path(settings.model_dir) / "tokenizer.json"))
    bos = tokenizer.token_to_id("<s>")
    rng = random.Random(5)
    tenant = f"bill-acc-{uuid.uuid4().hex[:6]}"
    prompts = [_prompt(tokenizer, rng, n) for n in (*SHORT_PROMPTS, *LONG_PROMPTS)]
    expected_prompt = {}
    requests = []
    for n, prompt in enumerate(prompts):
        token_ids = tokenizer.encode(prompt).ids
        assert token_ids[0] == bos  # the tokenizer adds <s> itself, as the engine's does
        max_tokens = rng.randint(4, 40)
        request = await client.submit(
            tenant_id=tenant,
            prompt=prompt,
            priority=n % 3,
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=n % 2 == 0),
        )
        requests.append(request)
        expected_prompt[request.request_id] = len(token_ids)
    counts = sorted(expected_prompt.values())
    assert 50 <= counts[0] and counts[len(SHORT_PROMPTS) - 1] <= 500  # short: 50-500
    assert counts[len(SHORT_PROMPTS)] >= 8192  # long: 8k and more

    streams = await asyncio.gather(*(_collect(client, r) for r in requests))
    received = {}
    for request, chunks in zip(requests, streams, strict=True):
        assert chunks[-1].error is None, chunks[-1].error
        received[request.request_id] = sum(c.num_tokens for c in chunks)
        if request.sampling.ignore_eos:
            assert received[request.request_id] == request.sampling.max_tokens

    ids = sorted(received)
    reported = await _usage_events(settings, set(ids))
    rows = await eventually(
        lambda: open_reader(settings).query(
            "SELECT request_id, prompt_tokens, completion_tokens, cached_tokens, cost_weight,"
            " cost_units, billed_units, price_version, status"
            " FROM usage_events WHERE request_id IN {ids:Array(String)}",  # no FINAL
            {"ids": ids},
        ),
        until=lambda rows: len(rows) >= len(ids),
    )
    assert sorted(r["request_id"] for r in rows) == ids  # one row per request, no copy

    pricer = Pricer(
        load_price_book(settings), PeakHours.parse(settings.peak_hours, settings.peak_hours_tz)
    )
    for row in rows:
        request_id = row["request_id"]
        event = reported[request_id]
        # The engine's counts, the independent counts, and the bill: all the same.
        assert event.num_prompt_tokens == expected_prompt[request_id]
        assert event.num_completion_tokens == received[request_id]
        assert row["prompt_tokens"] == event.num_prompt_tokens
        assert row["completion_tokens"] == event.num_completion_tokens
        assert row["cached_tokens"] == event.num_cached_tokens
        assert row["status"] == "ok"
        # And priced by the cost rule on those counts.
        weight = cost_weight(
            expected_prompt[request_id], event.precision, event.created_at, pricer.peak_hours
        )
        charge = pricer.charge(event)
        assert row["cost_weight"] == weight == charge.cost_weight
        assert Decimal(row["cost_units"]) == charge.cost_units  # Decimal, as JSON text
        assert Decimal(row["billed_units"]) == charge.billed_units
        assert row["price_version"] == charge.price_version >= 1
        if expected_prompt[request_id] >= 8192:
            assert weight >= 1.5
