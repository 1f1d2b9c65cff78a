"""Fleet checks that load a 2-core machine for minutes: a worker above the KV
threshold gets no new work, and the chaos test (SIGKILL a third of the fleet under
steady load from 20 tenants). ``make fleet`` runs them on the real stack; CI does not.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from aiokafka import TopicPartition
from tokenizers import Tokenizer

from producers import TokenbusClient
from schemas import InferenceRequest, SamplingParams, TokenChunkBatch, decode
from tests.integration.conftest import eventually
from tests.integration.fleet import SMALL_KV_WORKER, _drain, _usage, fleet, fleet_client
from tests.integration.test_quotas import as_time
from tests.load.chaos import instance_loss, under_steady_load
from tests.load.steady import worker_gauge, worker_gauges
from tokenbus.config import Settings
from tokenbus.kafka import make_consumer
from tokenbus_cli.stack import Stack

__all__ = ["fleet", "fleet_client"]


async def test_a_worker_above_the_kv_threshold_gets_no_new_work(
    fleet_client: TokenbusClient, fleet: Stack
) -> None:
    settings = fleet.settings

    def kv() -> float:
        return worker_gauge(settings, "kv_cache_usage", SMALL_KV_WORKER)

    # The small worker's cache holds 32 blocks of 128 tokens (4,096 tokens), and it
    # takes requests of up to 2,048. A filler of 1,800 prompt tokens takes 15 blocks at
    # its prefill, so two running fillers hold 30 of 32 blocks (94%) from their first
    # step to their last, and the ones waiting behind them keep it there. A burst of
    # fillers spreads over the three workers by seats; the small worker's share is
    # about a sixth.
    tokenizer = Tokenizer.from_file(str(settings.model_dir / "tokenizer.json"))
    prompt = "word " * 598
    num_prompt = len(tokenizer.encode(prompt).ids)
    assert 14 * 128 < num_prompt + 10 <= 15 * 128, num_prompt
    long = SamplingParams(max_tokens=2048 - num_prompt - 16, ignore_eos=True)
    # At once, so that the job routes all of them before any heartbeat shows them.
    requests = await asyncio.gather(
        *(
            fleet_client.submit(tenant_id="kv-fill", prompt=f"fill {n} {prompt}", sampling=long)
            for n in range(60)
        )
    )
    fillers = [(r, asyncio.create_task(_drain(fleet_client, r))) for r in requests]
    deadline = time.monotonic() + 60
    while not kv() > settings.route_kv_threshold:
        assert time.monotonic() < deadline, (
            f"{SMALL_KV_WORKER} KV use stayed at {kv():.2f}:\n{worker_gauges(settings)}"
        )
        await asyncio.sleep(0.2)
    try:
        # The job's view of the small worker changes only with its heartbeats (every
        # 0.5 s), and dips for a moment whenever a filler ends and the next one is
        # prefilled. So the view is sampled every 20 ms while probes go out in small
        # bursts; a probe counts as sent "while above" when the samples on both sides
        # of its dispatch, at most 100 ms apart, were above the threshold.
        samples: list[tuple[float, float]] = []
        sampling_done = asyncio.Event()

        async def sample() -> None:
            while not sampling_done.is_set():
                value = await asyncio.to_thread(kv)
                samples.append((time.time(), value))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        probes: list[InferenceRequest] = []
        for burst in range(20):
            probes += await asyncio.gather(
                *(
                    fleet_client.submit(
                        tenant_id="kv-probe",
                        prompt=f"short {burst}.{n}",
                        sampling=SamplingParams(max_tokens=8, ignore_eos=True),
                    )
                    for n in range(3)
                )
            )
            await asyncio.sleep(0.2)
        await asyncio.gather(*(_drain(fleet_client, r) for r in probes))
        sampling_done.set()
        await sampler
        rows = await eventually(
            lambda: _usage(settings, request_ids=[r.request_id for r in probes]),
            until=lambda rows: len(rows) == len(probes),
        )

        def above_at(when: float) -> bool:
            before = [(t, v) for t, v in samples if t <= when][-1:]
            after = [(t, v) for t, v in samples if t > when][:1]
            if not before or not after or after[0][0] - before[0][0] > 0.1:
                return False
            return min(before[0][1], after[0][1]) > settings.route_kv_threshold

        hot = Counter(
            row["worker_id"]
            for row in rows
            if above_at(as_time(row["created_at"]).timestamp() + row["queue_ms"] / 1000)
        )
        print(
            f"{SMALL_KV_WORKER} above {settings.route_kv_threshold:.0%} in "
            f"{sum(v > settings.route_kv_threshold for _, v in samples)} of {len(samples)} "
            f"samples; probes sent while above went to {dict(hot)}; all probes: "
            f"{dict(Counter(row['worker_id'] for row in rows))}"
        )
        assert hot.total() >= 10, hot  # enough to tell the rule from chance
        assert hot[SMALL_KV_WORKER] == 0, hot  # the others, which had room, took them
    finally:
        for request, _ in fillers:
            await fleet_client.cancel(request)
        await asyncio.gather(*(task for _, task in fillers))


async def test_chaos_a_third_of_the_fleet_is_killed_under_steady_load(fleet: Stack) -> None:
    # The instance-loss row of the chaos matrix (tests/load/chaos.py), on this fleet:
    # worker-2 is SIGKILLed mid-stream and started again.
    row = await under_steady_load(fleet, "chaos", instance_loss("worker-2"), baseline_s=20)
    audit = row.audit
    assert not row.unanswered, await _where_are_the_replies(fleet.settings, row.unanswered)
    # Every request ended: a gapless stream to a finish, or a clear error; billing holds
    # one run per request, and the tokens billed are the tokens delivered.
    assert audit.num_requests and audit.num_lost == 0, audit.line()
    assert audit.num_run_twice == 0, audit.line()
    assert audit.billing_exact, (audit.line(), audit.mismatched[:5])
    resumed = [r for r in audit.rows if "resumed" in r["flags"]]
    print(f"chaos: {audit.line()}; {len(resumed)} resumed; recovery {row.recovery_s} s")
    assert resumed, "the kill interrupted no stream"
    assert row.recovery_s is not None, "throughput not back to 90% within 90 s"


async def _where_are_the_replies(settings: Settings, requests: list[InferenceRequest]) -> str:
    """For a failure message: what the reply topic holds for each request, read from
    its first offset by a consumer of its own."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    wanted = {r.request_id for r in requests}
    found: dict[str, list[str]] = {r.request_id: [] for r in requests}
    last = -1
    try:
        tp = TopicPartition(requests[0].reply_to, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        while batches := await consumer.getmany(tp, timeout_ms=2000):
            for record in batches.get(tp, []):
                last = record.offset
                for chunk in decode(TokenChunkBatch, record.value).chunks:
                    if chunk.request_id in wanted:
                        found[chunk.request_id].append(f"{record.offset}:{chunk.seq}")
    finally:
        await consumer.stop()
    return f"no reply; {requests[0].reply_to} read to offset {last} holds (offset:seq) {found}"
