"""Steady load from many tenants, and the audit of what it got: the shared half of the
chaos rows (tests/load/chaos.py, ``make chaos``) and the fleet chaos test.

Each tenant runs a loop: submit, read the whole stream, think, again. The load records
what the clients received (tokens and the time they came, time to first token, every
chunk), and ``audit`` holds that against the billing table: a request with no final
chunk is lost, one that ran to completion twice is a duplicate, and the tokens billed
must be the tokens delivered, request by request.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from billing.dedup import SUPERSEDED
from producers import TokenbusClient, TokenbusTimeout
from schemas import InferenceRequest, SamplingParams, TokenChunk
from tests.integration.fleet import _usage
from tokenbus.chunks import Chunk
from tokenbus.config import Settings


def worker_gauge(settings: Settings, name: str, worker_id: str) -> float:
    """One of the job's per-worker gauges (``num_running``, ``tokens_per_s`` ...)."""
    url = f"http://127.0.0.1:{settings.faust_web_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"tokenbus_job_worker_{name}" and (
                sample.labels.get("worker") == worker_id
            ):
                return float(sample.value)
    return float("nan")


def worker_gauges(settings: Settings) -> str:
    """Every per-worker gauge of the job, for failure messages."""
    url = f"http://127.0.0.1:{settings.faust_web_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return "\n".join(line for line in lines if line.startswith("tokenbus_job_worker_"))


def num_mid_stream(
    outcomes: Mapping[str, Sequence[Chunk | TokenChunk]],
    request_ids: Collection[str] | None = None,
    at_most_tokens: int | None = None,
) -> int:
    """Streams that have begun and not ended (of ``request_ids``, if given), with at most
    ``at_most_tokens`` received (if given): far enough from their end that a fault now
    cuts them."""
    return sum(
        1
        for request_id, chunks in outcomes.items()
        if chunks
        and not chunks[-1].is_last
        and (request_ids is None or request_id in request_ids)
        and (at_most_tokens is None or sum(c.num_tokens for c in chunks) <= at_most_tokens)
    )


@dataclass
class SteadyLoad:
    client: TokenbusClient
    tenants: list[str]
    max_tokens: int = 48
    think_s: float = 2.0
    baseline_s: float = 30.0
    """How long the load runs before a fault, for the figures to compare against."""
    """Steady, not flat out: on two shared cores, under a saturating load, a restarting
    engine took 6-8 minutes to load."""
    outcomes: dict[str, list[Chunk]] = field(default_factory=dict)
    delivered: list[tuple[float, int]] = field(default_factory=list)
    """(monotonic time, tokens) as the clients receive them."""
    ttft: list[tuple[float, float, str]] = field(default_factory=list)
    """(monotonic time submitted, seconds to the first token, tenant)."""
    unanswered: list[InferenceRequest] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _loops: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._loops = [asyncio.create_task(self._tenant_loop(t)) for t in self.tenants]

    async def stop(self, timeout_s: float = 240) -> None:
        """Stops submitting; waits for every stream in flight to end."""
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._loops), timeout=timeout_s)

    def abandon(self) -> None:
        """Stops the tenants' loops at once, streams in flight and all."""
        self._stop.set()
        for loop in self._loops:
            loop.cancel()

    async def _tenant_loop(self, tenant: str) -> None:
        sampling = SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
        while not self._stop.is_set():
            submitted = time.monotonic()
            request = await self.client.submit(
                tenant_id=tenant, prompt=f"{tenant} steady load", sampling=sampling
            )
            chunks = self.outcomes.setdefault(request.request_id, [])
            try:
                async for chunk in self.client.stream(request):
                    now = time.monotonic()
                    if not chunks and chunk.error is None:
                        self.ttft.append((submitted, now - submitted, tenant))
                    chunks.append(chunk)
                    self.delivered.append((now, chunk.num_tokens))
            except TokenbusTimeout:
                self.unanswered.append(request)
                return
            await asyncio.sleep(self.think_s)

    def rate(self, since: float, until: float) -> float:
        """Tokens a second the clients received between two monotonic times."""
        return sum(n for t, n in self.delivered if since <= t < until) / (until - since)

    def ttft_quantiles(self, since: float, until: float) -> tuple[float, float]:
        """p50 and p99 of the time to first token of requests submitted in the span."""
        return self.ttft_quantiles_over([(since, until)])

    def ttft_quantiles_over(self, spans: Sequence[tuple[float, float]]) -> tuple[float, float]:
        """``ttft_quantiles`` of the requests submitted in any of ``spans``, pooled."""
        samples = sorted(
            s for t, s, _ in self.ttft if any(since <= t < until for since, until in spans)
        )
        if not samples:
            return float("nan"), float("nan")
        return tuple(  # type: ignore[return-value]
            samples[min(len(samples) - 1, int(q * len(samples)))] for q in (0.5, 0.99)
        )

    def mid_stream(
        self, request_ids: Collection[str] | None = None, at_most_tokens: int | None = None
    ) -> int:
        """Streams mid-way: see ``num_mid_stream``."""
        return num_mid_stream(self.outcomes, request_ids, at_most_tokens)

    def series(self, start: float, step_s: float = 10) -> str:
        marks = [start + step_s * k for k in range(int((time.monotonic() - start) // step_s))]
        return ", ".join(f"{t - start:+.0f}s {self.rate(t, t + step_s):.0f}" for t in marks)

    async def recovery_s(
        self, baseline: float, since: float, limit_s: float = 90, span_s: float = 10
    ) -> float | None:
        """Seconds from ``since`` to the start of the first ``span_s`` window (in 1 s
        steps) in which the clients received at least 90% of ``baseline`` tokens a
        second; None if no such window starts within ``limit_s``. Waits as needed."""
        while True:
            now = time.monotonic()
            for k in range(int(min(limit_s, now - span_s - since)) + 1):
                if self.rate(since + k, since + k + span_s) >= 0.9 * baseline:
                    return float(k)
            if now - since > limit_s + span_s:
                return None
            await asyncio.sleep(2)


@dataclass
class Audit:
    num_requests: int
    num_ok: int
    errors: dict[str, int]
    num_lost: int
    """No final chunk, a gap in its chunks, or no answer at all."""
    num_run_twice: int
    """Requests billed for more than one run to the end (status ``ok``, not superseded)."""
    num_superseded: int
    """Requests run again to the end, the second run stored but billed nothing: a worker
    presumed lost that finished anyway (``billing.dedup.later_runs``)."""
    num_extra_rows: int
    """Usage rows beyond one per request (attempts cut short by a failure, and copies)."""
    tokens_delivered: int
    tokens_billed: int
    num_unbilled: int
    """Requests with no usage row when the audit gave up waiting."""
    num_resumed: int
    """Requests whose stream another worker resumed (a usage row flagged ``resumed``)."""
    num_attempted_again: int
    """Requests run again from the start (a usage row of attempt 1 or later)."""
    mismatched: list[str]
    """Requests whose billed completion tokens differ from the delivered ones."""
    rows: list[dict[str, Any]]

    @property
    def billing_exact(self) -> bool:
        return not self.mismatched and not self.num_unbilled

    def line(self) -> str:
        return (
            f"{self.num_requests} requests ({self.num_ok} ok, errors {self.errors}), "
            f"lost {self.num_lost}, run twice {self.num_run_twice}, extra usage rows "
            f"{self.num_extra_rows}, {self.num_resumed} resumed, {self.num_attempted_again} "
            f"attempted again, {self.num_superseded} superseded, billed {self.tokens_billed} "
            f"/ delivered {self.tokens_delivered} tokens, {len(self.mismatched)} requests differ, "
            f"{self.num_unbilled} unbilled"
        )


async def audit(
    settings: Settings,
    outcomes: Mapping[str, Sequence[Chunk | TokenChunk]],
    tenants: list[str],
    *,
    num_unanswered: int = 0,
    timeout_s: float = 90,
) -> Audit:
    """What the clients received against what billing holds, once every request has a
    usage row (or ``timeout_s`` is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = await asyncio.to_thread(_usage, settings, tenants=tenants)
        if {r["request_id"] for r in rows} >= outcomes.keys() or time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    lost = num_unanswered
    errors: Counter[str] = Counter()
    for chunks in outcomes.values():
        if (
            not chunks
            or not chunks[-1].is_last
            or [c.seq for c in chunks] != list(range(len(chunks)))
        ):
            lost += 1
        elif chunks[-1].error is not None:
            errors[chunks[-1].error.code] += 1
    billed: Counter[str] = Counter()
    num_rows: Counter[str] = Counter()
    num_ok_rows: Counter[str] = Counter()
    superseded: set[str] = set()
    for row in rows:
        num_rows[row["request_id"]] += 1
        if SUPERSEDED in row["flags"]:  # stored with its cost, billed nothing
            superseded.add(row["request_id"])
            continue
        billed[row["request_id"]] += row["completion_tokens"]
        num_ok_rows[row["request_id"]] += row["status"] == "ok"
    sent = {rid: sum(c.num_tokens for c in chunks) for rid, chunks in outcomes.items()}
    return Audit(
        num_requests=len(outcomes),
        num_ok=sum(1 for c in outcomes.values() if c and c[-1].is_last and c[-1].error is None),
        errors=dict(errors),
        num_lost=lost,
        num_run_twice=sum(1 for n in num_ok_rows.values() if n > 1),
        num_superseded=len(superseded),
        num_extra_rows=sum(n - 1 for n in num_rows.values()),
        tokens_delivered=sum(sent.values()),
        tokens_billed=sum(billed[rid] for rid in sent),
        num_unbilled=sum(1 for rid in sent if rid not in num_rows),
        num_resumed=len({r["request_id"] for r in rows if "resumed" in r["flags"]}),
        num_attempted_again=len({r["request_id"] for r in rows if r["attempt"] > 0}),
        mismatched=sorted(rid for rid, n in sent.items() if billed[rid] != n),
        rows=rows,
    )
