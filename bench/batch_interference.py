"""Interference between a batch job and interactive traffic (issue 18), on one private stack.

    .venvs/stream/bin/python -m bench.batch_interference

In order, on one ``tokenbus_cli.stack.Stack`` (the tiny model, as ``bench.overhead``):

A. interactive baseline: class 1 waves at c=1 and c=16 (``TokenbusClient``), no batch;
B. class 1 throughput at full concurrency: completion tokens/s at c=64 for ``--full-s``;
C. a batch alone (``--batch-lines`` lines, submitted as ``tokenbus batch submit`` does:
   file and status document into the batch store, then a create command on
   ``<prefix>.batches``): its completion tokens/s over ``--batch-window-s`` once it
   ramped, against B (goal >= 0.8);
D. the same c=1 and c=16 waves while the batch runs: TTFT p99 against A (goal <= 1.5);
E. after D: seconds until the batch's tokens/s (3-s mean) is back to >= 80% of C
   (goal <= 30 s);
F. the batch cancelled (as ``tokenbus batch cancel`` does) and drained, A's waves and
   B's c=64 window once more: the baselines after. "Without the batch" is A and F
   pooled (the same number of requests before and after), and class 1's full rate is
   the mean of B and F's, so that what changed over the run and is not the batch (the
   machine's load; the bundled broker, whose fetches cost more the more record batches
   a partition holds, and the batch filled the shared topics) weighs on both sides of
   each ratio alike. The before-only and after-only ratios are printed beside them.

Batch tokens are counted from the usage topic: every ``UsageEvent`` with ``batch_id`` set,
bucketed per second by ``finished_at``. The runner's ``/metrics`` is scraped each second
for the pacer's limit (``tokenbus_batch_pacer_limit``) and the lines in flight
(``tokenbus_batch_lines{state="in_flight"}``), the timeline over C..E.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from aiokafka import TopicPartition
from rich.console import Console
from rich.table import Table

from bench.common import (
    UNLIMITED_TPM,
    add_settings_args,
    bench_settings,
    model_dir,
    parse_overrides,
    run_benchmark,
)
from bench.driver import RequestTrace, WaveResult, run_wave
from bench.procstat import CpuMeter, descendants
from bench.report import uptime_load
from bench.stats import ratio, summarize
from bench.workload import prompt, prompts, tenant
from producers import RequestFailed, TokenbusClient
from schemas import LoadReport, SamplingParams, SchemaError, UsageEvent, decode
from tokenbus.batch.store import BatchStore
from tokenbus.config import Settings
from tokenbus.topics import Topics
from tokenbus_cli.stack import Stack

INTERACTIVE_TENANT = tenant(0)
BATCH_TENANT = tenant(1)
GOAL_TTFT_RATIO = 1.5
GOAL_THROUGHPUT_RATIO = 0.8
GOAL_RECOVERY_S = 30.0
RECOVERY_FRACTION = 0.8
RECOVERY_MEAN_S = 3


# -- pure summarising parts (unit-tested) -------------------------------------------------


CLIENTS = "bench (clients)"
"""The CPU group of this process: the interactive clients and the batch's submission."""


def cpu_per_token(cpu_s: dict[str, float], tokens: float) -> dict[str, float]:
    """µs of CPU per token for each process, and of ``all`` (empty without tokens)."""
    if tokens <= 0 or not cpu_s:
        return {}
    per = {name: round(1e6 * used / tokens, 1) for name, used in cpu_s.items()}
    return {**per, "all": round(1e6 * sum(cpu_s.values()) / tokens, 1)}


def per_second(events: Sequence[tuple[float, int]]) -> dict[int, int]:
    """(epoch seconds, tokens) --> tokens per whole second."""
    buckets: dict[int, int] = {}
    for at, tokens in events:
        buckets[int(at)] = buckets.get(int(at), 0) + tokens
    return buckets


def window_tokens(buckets: dict[int, int], start: float, end: float) -> int:
    """Tokens in the whole seconds in [start, end)."""
    return sum(buckets.get(s, 0) for s in range(int(start), int(end)))


def window_rate(buckets: dict[int, int], start: float, end: float) -> float:
    """Tokens/s over the whole seconds in [start, end) (a second with none counts as 0)."""
    seconds = range(int(start), int(end))
    if not seconds:
        return 0.0
    return window_tokens(buckets, start, end) / len(seconds)


def trace_rate(traces: Sequence[RequestTrace], start: float, end: float) -> float:
    """Tokens/s of the deltas that arrived in [start, end) (perf_counter seconds)."""
    if end <= start:
        return 0.0
    tokens = sum(n for t in traces for at, n in t.arrivals if start <= at < end)
    return tokens / (end - start)


def recovery_s(
    buckets: dict[int, int], stopped: float, target: float, mean_s: int = RECOVERY_MEAN_S
) -> float | None:
    """Seconds from ``stopped`` until the ``mean_s``-second mean rate starting at a whole
    second first reaches ``target`` (None: not within the buckets recorded)."""
    if not buckets:
        return None
    last = max(buckets)
    for second in range(int(stopped), last - mean_s + 2):
        if window_rate(buckets, second, second + mean_s) >= target:
            return max(0.0, round(second - stopped, 1))
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """The runner's /metrics --> the pacer's limit and the lines in flight (summed over
    running batches); absent series are absent keys."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        if name == "tokenbus_batch_pacer_limit":
            found["limit"] = number
        elif name.startswith("tokenbus_batch_lines{") and 'state="in_flight"' in name:
            found["in_flight"] = found.get("in_flight", 0.0) + number
        elif name.startswith("tokenbus_batch_tokens{") and 'kind="completion"' in name:
            found["completion_tokens"] = found.get("completion_tokens", 0.0) + number
    return found


@dataclass
class Sample:
    at: float
    """epoch seconds"""
    limit: float | None
    in_flight: float | None


def timeline_summary(
    samples: Sequence[Sample], phases: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """Per phase: the pacer's limit and the lines in flight (min, median, max)."""
    out: dict[str, Any] = {}
    for phase, (start, end) in phases.items():
        inside = [s for s in samples if start <= s.at < end]
        entry: dict[str, Any] = {"seconds": round(end - start, 1), "samples": len(inside)}
        for key in ("limit", "in_flight"):
            values = [v for s in inside if (v := getattr(s, key)) is not None]
            entry[key] = (
                {"min": min(values), "median": statistics.median(values), "max": max(values)}
                if values
                else None
            )
        out[phase] = entry
    return out


def first_below(samples: Sequence[Sample], start: float, level: float) -> float | None:
    """Seconds from ``start`` until the pacer's limit first fell below ``level``."""
    for s in samples:
        if s.at >= start and s.limit is not None and s.limit < level:
            return round(s.at - start, 1)
    return None


def report_summary(reports: Sequence[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """What the pacer read in [start, end): the job's interactive TTFT and queue-wait p99
    (ms) and how many of its reports had class 0/1 requests waiting for a seat."""
    inside = [r for r in reports if start <= r["at"] < end]
    ttft = [r["ttft_p99"] for r in inside if r["ttft_p99"] is not None]
    queue = [r["queue_p99"] for r in inside if r["queue_p99"] is not None]
    return {
        "reports": len(inside),
        "with_interactive_waiting": sum(
            1 for r in inside if r["waiting_by_class"][0] + r["waiting_by_class"][1] > 0
        ),
        "ttft_p99_ms": summarize(ttft),
        "queue_p99_ms": summarize(queue),
    }


def pooled(*waves: WaveResult) -> WaveResult:
    """One wave of every request of ``waves`` (same concurrency): a baseline taken in parts."""
    return WaveResult(
        waves[0].concurrency,
        sum(w.wall_s for w in waves),
        [t for w in waves for t in w.traces],
    )


def goals(
    ttft_p99: dict[str, dict[int, float]],
    full_rates: dict[str, float],
    batch_rate: float,
    recovered_s: float | None,
) -> list[dict[str, Any]]:
    """Each acceptance line's figure beside its goal. ``ttft_p99["alone"]`` is the
    baseline the verdict takes; ``"alone_before"`` and ``"alone_after"``, when given, are
    its parts, each ratio shown beside it. Class 1's full rate is the mean of its runs
    before and after the batch (``full_rates``: equal windows), each shown beside it."""
    rows: list[dict[str, Any]] = []
    for concurrency in sorted(ttft_p99["alone"]):
        with_batch = ttft_p99["with_batch"][concurrency]
        value = ratio(with_batch, ttft_p99["alone"][concurrency])
        parts = {
            part: ratio(with_batch, ttft_p99[f"alone_{part}"][concurrency])
            for part in ("before", "after")
            if concurrency in ttft_p99.get(f"alone_{part}", {})
        }
        rows.append(
            {
                "figure": f"interactive TTFT p99 with/without batch, c={concurrency}",
                "value": value,
                "goal": f"<= {GOAL_TTFT_RATIO}",
                "met": value <= GOAL_TTFT_RATIO,
                **({"against_each_part": parts} if parts else {}),
            }
        )
    share = ratio(batch_rate, statistics.fmean(full_rates.values()))
    rows.append(
        {
            "figure": "batch tokens/s alone / class 1 tokens/s at c=64",
            "value": share,
            "goal": f">= {GOAL_THROUGHPUT_RATIO}",
            "met": share >= GOAL_THROUGHPUT_RATIO,
            **(
                {"against_each_part": {k: ratio(batch_rate, v) for k, v in full_rates.items()}}
                if len(full_rates) > 1
                else {}
            ),
        }
    )
    rows.append(
        {
            "figure": "seconds to >= 80% of batch speed after interactive stops",
            "value": recovered_s,
            "goal": f"<= {GOAL_RECOVERY_S:g}",
            "met": recovered_s is not None and recovered_s <= GOAL_RECOVERY_S,
        }
    )
    return rows


# -- I/O ------------------------------------------------------------------------------------


class PhaseCpu:
    """Cores each process used in each phase: a ``CpuMeter``'s CPU seconds between marks
    over wall seconds. A phase is named at its end (``mark``); the first mark only starts
    the clock."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self._meter = CpuMeter(groups)
        self._since: float | None = None
        self._phases: dict[str, dict[str, float]] = {}
        self._cpu_s: dict[str, dict[str, float]] = {}

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        if self._since is not None and now > self._since:
            wall = now - self._since
            used = self._meter.delta()
            self._phases[phase] = {k: round(v / wall, 3) for k, v in used.items()}
            self._cpu_s[phase] = {k: round(v, 3) for k, v in used.items()}
        self._meter.start()
        self._since = now

    def cores(self) -> dict[str, dict[str, float]]:
        return dict(self._phases)

    def cpu_s(self, phase: str) -> dict[str, float]:
        """CPU seconds each process used in ``phase`` (empty if it was not marked)."""
        return dict(self._cpu_s.get(phase, {}))


@dataclass
class UsageFollower:
    """Reads the usage and load topics from their ends: (finished_at, completion tokens)
    of batch lines, and the job's load reports (what the pacer reads)."""

    settings: Settings
    events: list[tuple[float, int]] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)

    async def run(self, ready: asyncio.Event) -> None:
        from tokenbus.kafka import make_consumer

        topics = Topics(self.settings.topic_prefix)
        consumer = make_consumer(self.settings, group_id=None)
        await consumer.start()
        try:
            tps = [
                TopicPartition(topic, p)
                for topic in (topics.usage, topics.load)
                for p in sorted(consumer.partitions_for_topic(topic) or {0})
            ]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            for tp in tps:
                await consumer.position(tp)
            ready.set()
            while True:
                fetched = await consumer.getmany(timeout_ms=500)
                for tp, records in fetched.items():
                    for record in records:
                        if tp.topic == topics.load:
                            self._note_report(record.value)
                            continue
                        try:
                            event = decode(UsageEvent, record.value)
                        except SchemaError:
                            continue
                        if event.batch_id is not None:
                            self.events.append(
                                (event.finished_at.timestamp(), event.num_completion_tokens)
                            )
        finally:
            await consumer.stop()

    def _note_report(self, raw: bytes | None) -> None:
        try:
            report = decode(LoadReport, raw)
        except SchemaError:
            return
        self.reports.append(
            {
                "at": report.sent_at.timestamp(),
                "waiting_by_class": report.num_waiting_by_class,
                "queue_p99": report.interactive_queue_ms_p99,
                "ttft_p99": report.interactive_ttft_ms_p99,
                "batch_in_flight": report.num_batch_in_flight,
            }
        )


@dataclass
class MetricsScraper:
    url: str
    samples: list[Sample] = field(default_factory=list)

    def scrape(self) -> Sample:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as response:
                found = parse_metrics(response.read().decode())
        except OSError:
            found = {}
        return Sample(time.time(), found.get("limit"), found.get("in_flight"))

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            self.samples.append(await asyncio.to_thread(self.scrape))
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))


def submit_batch(settings: Settings, lines: list[str], max_tokens: int) -> str:
    """Records a batch as ``tokenbus batch submit`` does (store, then checks); returns its id.
    The create command is sent separately (``send_create``)."""
    from bridge.admission import Planner
    from bridge.auth import Caller
    from bridge.batch_lines import BodyChecker
    from bridge.hygiene import PatternScreen
    from tokenbus.batch.submit import create_batch, file_doc
    from tokenbus.prompt_tokens import PromptCounter

    rows = [
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": settings.served_model_name,
                    "prompt": text,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            }
        )
        for i, text in enumerate(lines)
    ]
    data = ("\n".join(rows) + "\n").encode()
    planner = Planner(
        PatternScreen.create(
            settings.bridge_injection_patterns, settings.bridge_sensitive_patterns
        ),
        PromptCounter.from_model_dir(settings.model_dir),
        max_prompt_chars=settings.bridge_max_prompt_chars,
        knows_model=lambda model: model == settings.served_model_name,
    )
    directory = settings.tenant_directory()
    caller = Caller(tenant=directory.get(BATCH_TENANT), credential_id="bench", reply_prefix="")
    store = BatchStore(settings.batch_store)
    upload = file_doc(BATCH_TENANT, "bench.jsonl", len(data), time.time())
    store.put_file(upload, data)
    doc = create_batch(
        store,
        settings,
        tenant=BATCH_TENANT,
        input_file_id=upload.id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata=None,
        check_body=BodyChecker(planner, caller),
        now=time.time(),
    )
    if doc.is_terminal or doc.errors is not None:
        raise RuntimeError(f"batch refused lines: {doc.errors}")
    return doc.id


async def send_command_once(
    settings: Settings, kind: Literal["create", "cancel"], batch_id: str
) -> None:
    """The batch's create or cancel, as ``tokenbus batch`` sends it."""
    from tokenbus.batch.commands import send_command
    from tokenbus.kafka import make_producer

    producer = make_producer(settings)
    await producer.start()
    try:
        await send_command(producer, settings, kind, BATCH_TENANT, batch_id)
    finally:
        await producer.stop()


async def drain(
    follower: UsageFollower,
    scraper: MetricsScraper,
    ended: Callable[[], bool],
    *,
    quiet_s: float,
    timeout_s: float,
) -> bool:
    """Waits until the cancelled batch has ended (``ended``: its document is terminal, so
    the runner has written its output and error files), has no line in flight (the
    runner's ``/metrics``) and no batch line ended for ``quiet_s``; False if
    ``timeout_s`` passed first."""
    started = time.time()
    while time.time() - started < timeout_s:
        await asyncio.sleep(0.5)
        last = scraper.samples[-1] if scraper.samples else None
        idle = last is not None and last.at > started and not last.in_flight and ended()
        last_line = max((at for at, _ in follower.events), default=0.0)
        if idle and time.time() - max(last_line, started) >= quiet_s:
            return True
    return False


@dataclass
class Interactive:
    client: TokenbusClient
    max_tokens: int
    say: Callable[[str], None] = print

    def stream_fn(self, deadline: float | None = None) -> Any:
        sampling = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)

        async def stream(index: int, text: str) -> AsyncIterator[int]:
            if deadline is not None and time.perf_counter() >= deadline:
                return  # past the window: the lane stops taking prompts
            request = await self.client.submit(
                tenant_id=INTERACTIVE_TENANT, prompt=text, sampling=sampling, priority=1
            )
            async for chunk in self.client.stream(request):
                if chunk.error is not None:
                    raise RequestFailed(chunk.error)
                yield chunk.num_tokens

        return stream

    async def wave(self, tag: int, count: int, concurrency: int) -> WaveResult:
        return await run_wave(self.stream_fn(), prompts(tag, count), concurrency)

    async def waves(
        self, tag: int, args: argparse.Namespace, label: Callable[[int], str]
    ) -> dict[int, WaveResult]:
        """One wave at each of ``args.concurrency``, in order, each announced by ``label``."""
        done: dict[int, WaveResult] = {}
        for concurrency in args.concurrency:
            self.say(label(concurrency))
            size = wave_size(concurrency, args.requests_per_lane)
            done[concurrency] = await self.wave(tag, size, concurrency)
        return done

    async def full(self, tag: int, seconds: float, ramp_s: float) -> tuple[WaveResult, float]:
        """Class 1 at c=64 for ``seconds``: the wave, and the completion tokens/s of the
        deltas that arrived after its first ``ramp_s``."""
        start = time.perf_counter()
        deadline = start + seconds
        # Far more prompts than the window takes.
        wave = await run_wave(self.stream_fn(deadline), prompts(tag, 64 * 200), 64)
        return wave, trace_rate(wave.traces, start + ramp_s, deadline)


PERF_TO_EPOCH = time.time() - time.perf_counter()
"""Added to a ``perf_counter`` reading: seconds since the epoch (the workers' log times)."""


def wave_summary(wave: WaveResult, steps: Sequence[tuple[float, str]] = ()) -> dict[str, Any]:
    """The wave's summary, with the TTFT of its first request: in D, the one that meets
    the batch lines running, which a p99 over enough requests rightly leaves out, and
    which is shown apart so that it is not hidden; and what the workers' seat learners
    did during it (``steps``: epoch seconds, what), at ms from the wave's first start,
    as its ``sequence`` is."""
    first = min(
        (t for t in wave.traces if t.ttft_s is not None), key=lambda t: t.index, default=None
    )
    first_ms = None if first is None or first.ttft_s is None else round(first.ttft_s * 1000, 3)
    origin = min((t.started for t in wave.traces), default=0.0) + PERF_TO_EPOCH
    learner = [
        (round((at - origin) * 1000, 1), what)
        for at, what in steps
        if origin <= at <= origin + wave.wall_s
    ]
    return {
        **wave.summary(),
        "first_ttft_ms": first_ms,
        "sequence": ttft_sequence(wave),
        "learner": learner,
    }


def learner_steps(lines: Iterable[str]) -> list[tuple[float, str]]:
    """(epoch seconds, what) of each ``batch seats:`` line of a worker's text log
    (``workers.batch_gate.BatchGate.interactive_first_token``): when its seat learner
    let a batch line in beside interactive work, and when a probe held or failed."""
    found = []
    for line in lines:
        head, sep, rest = line.partition(" workers.batch_gate: batch seats: ")
        if not sep:
            continue
        at = datetime.strptime(head[:23], "%Y-%m-%d %H:%M:%S,%f")
        found.append((at.timestamp(), rest.split(" at ", 1)[0]))
    return found


def ttft_sequence(wave: WaveResult) -> list[tuple[float, float | None]]:
    """(ms from the wave's first start, TTFT ms) of each request in start order: where in
    the wave the slow requests fell."""
    traces = sorted(wave.traces, key=lambda t: t.started)
    if not traces:
        return []
    origin = traces[0].started
    return [
        (
            round((t.started - origin) * 1000, 1),
            None if t.ttft_s is None else round(t.ttft_s * 1000, 1),
        )
        for t in traces
    ]


def wave_size(concurrency: int, per_lane: int) -> int:
    """Requests in a wave at ``concurrency``: ``per_lane`` for each of its lanes. The lanes
    run in step (an engine step takes a whole burst, so its requests share one time to
    first token), so a wave holds ``per_lane`` independent samples whatever its
    concurrency, and a p99 wants 100 or more: over 8 bursts of 16 it is the worst burst."""
    return concurrency * per_lane


def ttft_p99(wave: WaveResult) -> float:
    value = wave.summary()["ttft_ms"].get("p99", 0.0)
    return float(value)


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    overrides = {"default_batch_tpm": UNLIMITED_TPM, **parse_overrides(args.set)}
    settings = bench_settings(model_path=model_dir(), **overrides)
    (settings.home / "logs").mkdir(parents=True, exist_ok=True)
    console.print(f"[dim]TOKENBUS_HOME={settings.home}  load {load_start['load_1_5_15']}[/]")
    stack = Stack(settings, on_progress=lambda m: console.print(f"[dim]stack: {m}[/]"))
    say = console.print
    waves: dict[str, dict[int, WaveResult]] = {
        "alone_before": {},
        "with_batch": {},
        "alone_after": {},
    }
    phases: dict[str, tuple[float, float]] = {}
    follower = UsageFollower(settings)
    scraper = MetricsScraper(f"http://127.0.0.1:{settings.batch_port}/metrics")
    tasks: list[asyncio.Task[None]] = []
    try:
        await stack.start()
        groups = {
            srv.name: [srv.process.pid, *descendants(srv.process.pid)] for srv in stack.services
        }
        cpu = PhaseCpu({**groups, CLIENTS: [os.getpid()]})
        async with TokenbusClient(settings) as client:
            bus = Interactive(client, args.max_tokens, say)
            say("warm-up")
            await bus.wave(-1, 16, 8)
            # A
            cpu.mark("start")
            waves["alone_before"] = await bus.waves(
                0, args, lambda c: f"A: class 1 c={c}, no batch"
            )
            # B
            cpu.mark("A_interactive_alone")
            say(f"B: class 1 c=64 for {args.full_s} s")
            full, full_rate = await bus.full(1, args.full_s, args.ramp_s)
            # C
            cpu.mark("B_class1_full")
            ready = asyncio.Event()
            tasks.append(asyncio.create_task(follower.run(ready)))
            await ready.wait()
            tasks.append(asyncio.create_task(scraper.run()))
            say(f"C: submitting a batch of {args.batch_lines} lines")
            lines = [prompt(2, i) for i in range(args.batch_lines)]
            batch_id = await asyncio.to_thread(submit_batch, settings, lines, args.max_tokens)
            submitted = time.time()
            await send_command_once(settings, "create", batch_id)
            while not follower.events:
                if time.time() - submitted > 120:
                    raise RuntimeError("the batch produced no tokens in 120 s")
                await asyncio.sleep(0.5)
            first_token = time.time()
            say(f"C: batch running ({first_token - submitted:.1f} s to its first line)")
            ceiling = settings.batch_max_in_flight
            while not any(s.limit == ceiling for s in scraper.samples if s.at >= first_token):
                if time.time() - first_token > args.ramp_timeout_s:
                    break  # measured from here all the same; the timeline shows the limit
                await asyncio.sleep(0.5)
            ramped = time.time()
            say(f"C: pacer at its ceiling after {ramped - first_token:.1f} s; measuring")
            await asyncio.sleep(args.ramp_s + args.batch_window_s + 1)
            c_start = float(int(ramped + args.ramp_s) + 1)
            c_end = c_start + args.batch_window_s
            phases["C_batch_alone"] = (submitted, time.time())
            # D
            cpu.mark("C_batch_alone")
            d_start = time.time()
            waves["with_batch"] = await bus.waves(
                3, args, lambda c: f"D: class 1 c={c} beside the batch"
            )
            d_end = time.time()
            cpu.mark("D_interactive_with_batch")
            phases["D_interactive_with_batch"] = (d_start, d_end)
            # E
            await asyncio.sleep(1.5)  # usage events of the window land
            batch_rate = window_rate(per_second(follower.events), c_start, c_end)
            target = RECOVERY_FRACTION * batch_rate
            say(f"E: waiting for the batch back at >= {target:.0f} tokens/s")
            recovered: float | None = None
            while time.time() - d_end < args.recovery_timeout_s:
                await asyncio.sleep(1.0)
                buckets = per_second([e for e in follower.events if e[0] < time.time() - 1.5])
                recovered = recovery_s(buckets, d_end, target)
                if recovered is not None:
                    break
            await asyncio.sleep(2.0)
            e_end = time.time()
            phases["E_after_interactive"] = (d_end, e_end)
            # F
            say("F: cancelling the batch; waiting for its running lines to end")
            await send_command_once(settings, "cancel", batch_id)
            store = BatchStore(settings.batch_store)

            def ended() -> bool:
                return store.batch(BATCH_TENANT, batch_id).is_terminal

            drained = await drain(follower, scraper, ended, quiet_s=args.quiet_s, timeout_s=120.0)
            say(f"F: batch drained: {drained}")
            cpu.mark("E_F_recovery_and_cancel")
            f_start = time.time()
            waves["alone_after"] = await bus.waves(
                4, args, lambda c: f"F: class 1 c={c}, the batch gone"
            )
            phases["F_batch_cancelled"] = (e_end, f_start)
            phases["F_interactive_after"] = (f_start, time.time())
            cpu.mark("F_interactive_after")
            say(f"F: class 1 c=64 for {args.full_s} s, the batch gone")
            full_after, full_rate_after = await bus.full(5, args.full_s, args.ramp_s)
            cpu.mark("F_class1_full")
            stack.check()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stack.stop()
    load_end = uptime_load()
    steps = sorted(
        step
        for log in (settings.home / "logs").glob("worker-*.log")
        for step in learner_steps(log.read_text(errors="replace").splitlines())
    )
    if not args.keep:
        shutil.rmtree(settings.home, ignore_errors=True)
    buckets = per_second(follower.events)
    reports = {int(r["at"]): r for r in follower.reports}
    waves["alone"] = {
        c: pooled(w, waves["alone_after"][c]) for c, w in waves["alone_before"].items()
    }
    p99 = {k: {c: ttft_p99(w) for c, w in v.items()} for k, v in waves.items()}
    origin = phases["C_batch_alone"][0]
    return {
        "command": "python -m bench.batch_interference " + " ".join(args.argv),
        "parameters": {
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "full_s": args.full_s,
            "ramp_s": args.ramp_s,
            "batch_window_s": args.batch_window_s,
            "batch_lines": args.batch_lines,
            "settings_overrides": overrides,
            "batch_max_in_flight": settings.batch_max_in_flight,
            "stream_interval": settings.stream_interval,
            "batch_stream_interval": settings.batch_stream_interval,
            "batch_tokens_counted_from": "usage topic, events with batch_id, per second "
            "by finished_at",
            "sampling": "temperature 0, ignore_eos, fixed max_tokens; ~150-token unique prompts",
        },
        "load_start": load_start,
        "load_end": load_end,
        "batch_id": batch_id,
        "interactive": {
            k: {str(c): wave_summary(w, steps) for c, w in v.items()} for k, v in waves.items()
        },
        "full_concurrency": {**full.summary(), "window_tokens_per_s": round(full_rate, 1)},
        "full_concurrency_after": {
            **full_after.summary(),
            "window_tokens_per_s": round(full_rate_after, 1),
        },
        "batch_alone_tokens_per_s": round(batch_rate, 1),
        "pacer_ramp_s": round(ramped - first_token, 1),
        "job_reports_in_D": report_summary(follower.reports, *phases["D_interactive_with_batch"]),
        "batch_window": [c_start, c_end],
        "recovery_s": recovered,
        "goals": goals(p99, {"before": full_rate, "after": full_rate_after}, batch_rate, recovered),
        "pacer_timeline": timeline_summary(scraper.samples, phases),
        "pacer_first_backoff_s": first_below(
            scraper.samples, phases["D_interactive_with_batch"][0], settings.batch_max_in_flight
        ),
        "timeline": [
            {
                "t": round(s.at - origin, 1),
                "limit": s.limit,
                "in_flight": s.in_flight,
                "batch_tokens": buckets.get(int(s.at), 0),
                "job_report": reports.get(int(s.at)),
            }
            for s in scraper.samples
        ],
        "phases": {k: [round(a - origin, 1), round(b - origin, 1)] for k, (a, b) in phases.items()},
        "cores_by_phase": cpu.cores(),
        # The stack's CPU in C (the batch alone) over the batch tokens finished in it.
        "cpu_us_per_batch_token_in_C": cpu_per_token(
            {k: v for k, v in cpu.cpu_s("C_batch_alone").items() if k != CLIENTS},
            window_tokens(buckets, *phases["C_batch_alone"]),
        ),
    }


def _spread(ttft_ms: dict[str, float]) -> str:
    return " / ".join(f"{ttft_ms.get(k, float('nan')):.0f}" for k in ("p50", "p99", "max"))


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title="Batch jobs: interference (tiny model)")
    for column in ("figure", "value", "goal", "met", "against before / after alone"):
        table.add_column(column, justify="right")
    for row in result["goals"]:
        parts = row.get("against_each_part")
        table.add_row(
            row["figure"],
            str(row["value"]),
            row["goal"],
            "yes" if row["met"] else "NO",
            f"{parts['before']} / {parts['after']}" if parts else "",
        )
    console.print(table)
    ttft = Table(title="interactive class 1 TTFT (ms), p50 / p99 / max")
    columns = (
        "conc",
        "n",
        "alone before",
        "alone after",
        "alone, both",
        "w/ batch",
        "first w/ batch",
    )
    for column in columns:
        ttft.add_column(column, justify="right")
    interactive = result["interactive"]
    for c, beside in interactive["with_batch"].items():
        arms = [interactive[k][c]["ttft_ms"] for k in ("alone_before", "alone_after", "alone")]
        b = beside["ttft_ms"]
        ttft.add_row(
            c,
            f"{arms[2]['n']} / {b['n']}",
            *(_spread(a) for a in arms),
            _spread(b),
            str(beside["first_ttft_ms"]),
        )
    console.print(ttft)
    phases = Table(title="pacer limit / batch lines in flight per phase (min/median/max)")
    for column in ("phase", "seconds", "limit", "in flight"):
        phases.add_column(column, justify="right")
    for name, entry in result["pacer_timeline"].items():
        cells = [
            "-" if entry[k] is None else "{min:g}/{median:g}/{max:g}".format(**entry[k])
            for k in ("limit", "in_flight")
        ]
        phases.add_row(name, str(entry["seconds"]), *cells)
    console.print(phases)
    by_phase = result.get("cores_by_phase") or {}
    if by_phase:
        cores = Table(title="cores each process used, per phase")
        names = sorted({name for row in by_phase.values() for name in row})
        for column in ("phase", *names):
            cores.add_column(column, justify="right")
        for phase, row in by_phase.items():
            cores.add_row(phase, *(f"{row.get(name, 0.0):.2f}" for name in names))
        console.print(cores)
    seen = result["job_reports_in_D"]
    console.print(
        f"the job's reports in D (what the pacer read): {seen['reports']}, "
        f"{seen['with_interactive_waiting']} with class 0/1 waiting; TTFT p99 ms "
        f"{seen['ttft_p99_ms']}; queue p99 ms {seen['queue_p99_ms']}"
    )
    console.print(
        f"class 1 c=64: {result['full_concurrency']['window_tokens_per_s']} tok/s before, "
        f"{result['full_concurrency_after']['window_tokens_per_s']} after; batch alone "
        f"{result['batch_alone_tokens_per_s']} tok/s; first back-off "
        f"{result['pacer_first_backoff_s']} s into D; load {result['load_start']['load_1_5_15']}"
        f" -> {result['load_end']['load_1_5_15']}"
    )


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--requests-per-lane",
        type=int,
        default=128,
        help="per interactive wave, times its concurrency (wave_size)",
    )
    parser.add_argument("--full-s", type=float, default=20.0, help="B: class 1 at c=64")
    parser.add_argument("--ramp-s", type=float, default=3.0, help="skipped before B's and C's")
    parser.add_argument("--batch-window-s", type=float, default=30.0, help="C: measured")
    parser.add_argument("--batch-lines", type=int, default=20_000)
    parser.add_argument(
        "--ramp-timeout-s", type=float, default=40.0, help="C: most wait for the pacer's ceiling"
    )
    parser.add_argument("--recovery-timeout-s", type=float, default=60.0)
    parser.add_argument(
        "--quiet-s",
        type=float,
        default=5.0,
        help="F: seconds with no batch line ending before the baseline after is taken",
    )
    parser.add_argument("--name", default="batch_interference", help="result file name")
    add_settings_args(parser)
    run_benchmark(parser, argv, measure, render)


if __name__ == "__main__":
    main()
