"""The job's own work per admitted request, in one process: the dispatcher without Faust
and the broker.

    .venvs/stream/bin/python -m bench.admit_work [--requests 20000] [--repeat 5] [--profile]

``bench.admission`` measures the Faust job's whole process: Faust's per-event machinery,
aiokafka's produce and fetch, the dispatcher. Its floors (``bench.faust_floor``) give
what Faust and aiokafka cost a forward and a ledger record. This gives the other part,
tokenbus's own: the job's ``Dispatcher`` admits the records ``bench.admission`` sends
(each tenant's service token, the bridge's vouched prompt count, no ``traceparent``, so
each admission starts its trace) and forwards them to one worker, in one event loop,
with the job's ledger and quota windows (``TableLedger``, ``TableWindowStore``) over an
in-memory table and a publisher that acknowledges at once. As in the admit agent, a
batch of up to 256 requests is judged in tasks of their own while the dispatch loop
forwards; the job's spans go to its span buffer and are taken (encoded, not sent) after
each batch. The cycle collector is set as the job sets it (``tokenbus.heap``).

CPU time of this process per request (``time.process_time``), the median of
``--repeat`` runs with its spread, with tracing as configured (every trace kept) and
with ``trace_sample_ratio=0`` in alternate runs: the difference is what tracing costs
the job's own code. No other process runs, so the machine's load moves it far less than
it moves ``bench.admission``. ``--profile`` prints cProfile's view of one more run
(cProfile's own cost inflates every call; read it for shares, not µs).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

from rich.progress import Progress

from bench.admission import Credentials, bridge_count, build_requests, reply_topic
from bench.common import bench_settings, model_dir
from bench.report import uptime_load, write_result
from bench.stats import spread
from schemas import WorkerStatus, encode
from stream_jobs.app import TableLedger, TableWindowStore
from stream_jobs.dispatcher import Admitted, Dispatcher, Outcome, Record
from tokenbus.config import Settings
from tokenbus.heap import freeze_startup_heap
from tokenbus.topics import Topics
from tokenbus.tracing import Tracing

BATCH = 256
"""Requests judged together, as the admit agent's batch (``admit_batch_max``)."""
WORKER = "bench-worker"
PROMPT_TOKENS = 150
"""As ``bench.admission``'s records (its default)."""
BATCH_TIMEOUT_S = 60.0
WORKER_SEATS = 0
"""The worker's ``max_num_seqs``; 0: four times the run's requests, so none waits."""


class _Acked(NamedTuple):
    """The broker's acknowledgement of a record, as the dispatcher reads it."""

    topic: str
    partition: int
    offset: int


class _Table(dict[bytes, bytes]):
    """What ``TableLedger`` uses of a Faust table, in memory: the store, its ``data``
    (written without a record), and ``send_changelog`` (no broker: nothing is sent)."""

    @property
    def data(self) -> dict[bytes, bytes]:
        return self

    def send_changelog(self, partition: int, key: bytes, value: bytes) -> None:
        return None


class _NoReplies:
    """The reply log: no request is ever a duplicate here, so it is never read."""

    async def read(self, **_: object) -> list[Any]:
        return []


class _Publisher:
    """Acknowledges each record at once, at the next offset of partition 0."""

    def __init__(self) -> None:
        self.num_sent = 0

    async def __call__(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> _Acked:
        self.num_sent += 1
        return _Acked(topic, 0, self.num_sent)


def _records(settings: Settings, num_requests: int, num_tenants: int) -> list[Record]:
    """``bench.admission``'s records, as the bridge sends them (its vouched count)."""
    payload = build_requests(
        num_requests,
        num_tenants,
        PROMPT_TOKENS,
        settings.served_model_name,
        reply_topic(settings),
        Credentials(settings),
        bridge_count(settings, PROMPT_TOKENS),
    )
    topic = Topics(settings.topic_prefix).requests(1)
    return [
        Record(topic, n % num_tenants, n, tenant_id.encode(), value, headers)
        for n, (tenant_id, value, headers) in enumerate(payload)
    ]


async def _one(dispatcher: Dispatcher, record: Record) -> Outcome:
    # As the admit agent's handler: admit, then see an admitted request to its forward.
    result = await dispatcher.admit(record)
    if isinstance(result, Admitted):
        return await dispatcher.finish(result)
    return result


async def run_once(
    num_requests: int,
    num_tenants: int,
    trace_ratio: float,
    profile: cProfile.Profile | None = None,
) -> dict[str, Any]:
    """One run: µs of this process's CPU per request, and what became of the requests."""
    settings = bench_settings(
        home=Path(tempfile.mkdtemp(prefix="tokenbus-admit-work-")),
        model_path=model_dir(),
        trace_sample_ratio=trace_ratio,
        worker_dead_after_s=3600.0,
    )
    tracing = Tracing(settings, "job")
    ledger = TableLedger(cast(Any, _Table()))
    publish = _Publisher()
    dispatcher = Dispatcher(
        settings,
        publish,
        TableWindowStore(ledger),
        _NoReplies(),
        ledger,
        tracer=tracing.tracer,
    )
    status = WorkerStatus(
        worker_id=WORKER,
        model=settings.served_model_name,
        request_topic=Topics(settings.topic_prefix).worker(WORKER),
        max_num_seqs=WORKER_SEATS or 4 * (num_requests + BATCH),  # to spare, with the VIP seats
        incarnation="bench",
    )
    dispatcher.observe_heartbeat(encode(status))
    records = _records(settings, num_requests + BATCH, num_tenants)
    loop = asyncio.create_task(dispatcher.run())

    async def spans_taken(*_: object, **__: object) -> None:
        return None

    async def batch(part: list[Record]) -> list[Outcome]:
        async with asyncio.timeout(BATCH_TIMEOUT_S):  # a request left waiting fails the run
            outcomes = await asyncio.gather(*(_one(dispatcher, r) for r in part))
        await tracing.flush(spans_taken)
        return outcomes

    try:
        await batch(records[:BATCH])  # warm: first calls, the tenants' windows
        freeze_startup_heap("admit_work", settings.gc_gen0_threshold)
        outcomes: list[Outcome] = []
        if profile is not None:
            profile.enable()
        began = time.process_time()
        for start in range(BATCH, len(records), BATCH):
            outcomes += await batch(records[start : start + BATCH])
        cpu_s = time.process_time() - began
        if profile is not None:
            profile.disable()
    finally:
        loop.cancel()
    counts = {o.value: outcomes.count(o) for o in set(outcomes)}
    if counts != {Outcome.FORWARDED.value: num_requests}:
        raise RuntimeError(f"expected {num_requests} forwards, got {counts}")
    return {"us_per_request": cpu_s / num_requests * 1e6, "outcomes": counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile one more run")
    parser.add_argument("--name", default="admit_work")
    args = parser.parse_args()
    load = uptime_load()
    traced: list[float] = []
    untraced: list[float] = []
    with Progress(transient=True) as progress:
        task = progress.add_task("admitting", total=2 * args.repeat)
        for _ in range(args.repeat):  # alternated, so drift on the machine hits both
            for ratio, runs in ((1.0, traced), (0.0, untraced)):
                result = asyncio.run(run_once(args.requests, args.tenants, ratio))
                runs.append(result["us_per_request"])
                progress.advance(task)
    payload = {
        "load_start": load,
        "num_requests": args.requests,
        "num_tenants": args.tenants,
        "us_per_request_traced": traced,
        "us_per_request_untraced": untraced,
        "traced": spread(traced, digits=1),
        "untraced": spread(untraced, digits=1),
        "tracing": spread([t - u for t, u in zip(traced, untraced, strict=True)], digits=1),
    }
    path = write_result(args.name, payload)
    print("| the job's own work per request, CPU µs | median | min..max |")
    print("|---|---|---|")
    for label, key in (
        ("every trace kept (the default)", "traced"),
        ("tracing off (`trace_sample_ratio=0`)", "untraced"),
        ("tracing's share (each pair's difference)", "tracing"),
    ):
        s = payload[key]
        print(f"| {label} | {s['median']:.1f} | {s['min']:.1f}..{s['max']:.1f} |")
    print(f"\n{args.repeat} pairs of {args.requests} requests; written to {path}")
    if args.profile:
        profile = cProfile.Profile()
        asyncio.run(run_once(args.requests, args.tenants, 1.0, profile))
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
