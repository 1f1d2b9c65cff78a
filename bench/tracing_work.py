"""Tracing's own work per request, measured directly: every service's span code for one
request, run in one process with the request sampled and not, CPU µs per request.

    .venvs/stream/bin/python -m bench.tracing_work --requests 2000

The A/B of ``bench.tracing_cost`` measures tracing on the real stack, where a 3% effect
hides in the noise of a loaded machine. This measures only what tracing adds, stage by
stage, with the same calls the services make (``tokenbus.tracing``,
``tokenbus.span_path``): the bridge's request with its path spans and the reply's hop,
the job's hop, admission and queue with the forward's headers, the worker's hop, request
and engine phases with the usage record's headers, billing's insert span, each service's
flush into span batches (the ``SpanBuffer`` and ``orjson``), and the span sink's decode,
rows and ClickHouse insert (chdb in memory). Divided by the tokens of a request, it is
set beside the tokenbus CPU per token that ``bench.tracing_cost`` measured
(``--per-token-us``), as the share tracing costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import (
    SpanKind,
    set_span_in_context,
    use_span,
)
from rich.console import Console
from rich.table import Table

from bench.common import run_benchmark
from bench.report import uptime_load
from billing.span_codec import decode_spans
from billing.span_sink import SpanStore
from billing.traces import span_rows
from tokenbus.config import Settings
from tokenbus.finished_span import end_span
from tokenbus.lean_span import start_span
from tokenbus.span_path import SpanPath, hop_span, path_ns
from tokenbus.tracing import (
    Tracing,
    extract,
    extract_http,
    inject,
    span_attributes,
    token_attributes,
    with_path,
)
from workers.worker import PATH_PHASES, path_edges, request_span

TENANT = "bench-0"
STAGES = ("bridge", "job", "worker", "billing", "flush", "sink")


def caller_headers(sampled: bool) -> dict[str, str]:
    trace_id = int.from_bytes(os.urandom(16), "big") | 1
    span_id = int.from_bytes(os.urandom(8), "big") | 1
    flags = "01" if sampled else "00"
    return {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-{flags}"}


class Services:
    """One ``Tracing`` per service, and one request's span work in each, as the services
    do it (the same calls, minus their I/O)."""

    def __init__(self, settings: Settings) -> None:
        self.bridge = Tracing(settings, "bridge")
        self.job = Tracing(settings, "job")
        self.worker = Tracing(settings, "worker")
        self.billing = Tracing(settings, "billing")
        self.all = (self.bridge, self.job, self.worker, self.billing)
        self.flush_interval_s = settings.trace_flush_interval_s
        self.gather_s = settings.span_gather_s

    def bridge_request(self, http_headers: dict[str, str], n: int) -> list[tuple[str, bytes]]:
        tracer = self.bridge.tracer
        received = time.time_ns()
        span = start_span(
            tracer,
            "bridge.request",
            context=extract_http(http_headers),
            kind=SpanKind.SERVER,
            start_time=received - 1000,
        )
        token = otel_context.attach(set_span_in_context(span))
        path = SpanPath(tracer, received)
        tenant = {"tokenbus.tenant": TENANT}
        with path.step("bridge.auth") as auth:
            auth.set_attributes(tenant)
        end_span(tracer, "bridge.arrival", received - 1000, received, tenant)
        span.set_attributes(span_attributes(tenant=TENANT, request_id=f"r{n}", session_id="s"))
        with path.step("bridge.hygiene", attributes=tenant):
            pass
        waiting = path.begin("bridge.admission_wait", attributes=tenant)
        headers: list[tuple[str, bytes]] = [("authorization", b"Bearer x")]
        inject(headers, with_path(path.at, set_span_in_context(waiting)))
        taken = path.end(waiting)
        context = set_span_in_context(waiting)
        hop_span(tracer, "bus.reply", taken - 500, taken, tenant, context=context)
        relaying = start_span(tracer, "bridge.relay", attributes=tenant)
        first_event = path.begin("bridge.first_event", attributes=tenant)
        first_event.end()
        relaying.end()
        span.end()
        otel_context.detach(token)
        return headers

    def job_request(self, headers: list[tuple[str, bytes]], n: int) -> list[tuple[str, bytes]]:
        tracer = self.job.tracer
        parent = extract(headers)
        taken = time.time_ns()
        span = start_span(
            tracer, "job.admit", context=parent, kind=SpanKind.CONSUMER, start_time=taken
        )
        span.set_attributes(
            span_attributes(
                tenant=TENANT, request_id=f"r{n}", session_id="s", priority=1, model="m"
            )
        )
        span.set_attribute("tokenbus.outcome", "admitted")
        if span.is_recording():
            hop_span(
                tracer,
                "bus.request",
                path_ns(headers),
                taken,
                {"tokenbus.tenant": TENANT},
                context=parent,
            )
        queued_ns = time.time_ns()
        span.end(end_time=queued_ns)
        queued = start_span(
            tracer,
            "job.queue",
            context=set_span_in_context(span),
            start_time=queued_ns,
            kind=SpanKind.PRODUCER,
            attributes=span_attributes(
                tenant=TENANT, request_id=f"r{n}", attempt=0, priority=1, worker="w"
            ),
        )
        sent = time.time_ns()
        forward: list[tuple[str, bytes]] = []
        inject(forward, with_path(sent, set_span_in_context(queued)))
        queued.end(end_time=sent)
        return forward

    def worker_request(self, headers: list[tuple[str, bytes]], n: int) -> list[tuple[str, bytes]]:
        tracer = self.worker.tracer
        taken = time.time_ns()
        attributes = span_attributes(
            tenant=TENANT,
            request_id=f"r{n}",
            session_id="s",
            attempt=0,
            priority=1,
            model="m",
            worker="w",
        )
        usage: list[tuple[str, bytes]] = []
        hop = {"tokenbus.tenant": TENANT}
        with use_span(
            request_span(tracer, headers, taken, attributes, hop), end_on_exit=True
        ) as span:
            span.set_attributes(token_attributes(16, 64, 0))
            if span.is_recording():
                phase_attributes = span_attributes(tenant=TENANT, request_id=f"r{n}", attempt=0)
                edges = path_edges(taken, [taken + 10, taken + 20, taken + 30], taken + 40)
                phases = [
                    *zip(PATH_PHASES, edges, edges[1:], strict=False),
                    ("worker.decode", edges[3], edges[3] + 50),
                ]
                for name, start, end in phases:
                    end_span(tracer, name, start, end, phase_attributes)
            inject(usage)
        return usage

    def billing_insert(self, headers: list[tuple[str, bytes]], n: int) -> None:
        started = time.time_ns()
        end_span(
            self.billing.tracer,
            "billing.insert",
            started,
            started + 1000,
            {
                **span_attributes(tenant=TENANT, request_id=f"r{n}", attempt=0),
                "tokenbus.num_rows": 100,
            },
            context=extract(headers),
            kind=SpanKind.CONSUMER,
        )


async def flush_all(services: Services) -> list[tuple[bytes, bytes]]:
    sent: list[tuple[bytes, bytes]] = []

    async def publish(topic: str, key: bytes, value: bytes, headers: Any = None) -> None:
        sent.append((key, value))

    for tracing in services.all:
        await tracing.flush(publish)
    return sent


def one_arm(
    services: Services,
    store: SpanStore,
    sampled: bool,
    num_requests: int,
    loop: asyncio.AbstractEventLoop,
    requests_per_s: int,
) -> tuple[dict[str, float], int]:
    """CPU seconds of each stage over ``num_requests`` requests; the spans stored. At
    ``requests_per_s``, each service flushes every ``trace_flush_interval_s`` (1 s) and
    the sink inserts what ``span_gather_s`` brought, as on the stack."""
    cpu = dict.fromkeys(STAGES, 0.0)
    clock = time.process_time
    flush_every = max(1, round(requests_per_s * services.flush_interval_s))
    insert_every = max(1, round(requests_per_s * services.gather_s))
    pending: list[tuple[Any, ...]] = []
    num_spans = 0
    for n in range(num_requests):
        t0 = clock()
        to_job = services.bridge_request(caller_headers(sampled), n)
        t1 = clock()
        to_worker = services.job_request(to_job, n)
        t2 = clock()
        usage = services.worker_request(to_worker, n)
        t3 = clock()
        services.billing_insert(usage, n)
        t4 = clock()
        cpu["bridge"] += t1 - t0
        cpu["job"] += t2 - t1
        cpu["worker"] += t3 - t2
        cpu["billing"] += t4 - t3
        last = n == num_requests - 1
        if (n + 1) % flush_every == 0 or last:
            t0 = clock()
            records = loop.run_until_complete(flush_all(services))
            t1 = clock()
            pending += [row for _, value in records for row in _rows(value)]
            t2 = clock()
            cpu["flush"] += t1 - t0
            cpu["sink"] += t2 - t1
        if (n + 1) % insert_every == 0 or last:
            t0 = clock()
            if pending:
                store.insert_spans(pending)
            cpu["sink"] += clock() - t0
            num_spans += len(pending)
            pending = []
    return cpu, num_spans


def _rows(value: bytes) -> list[tuple[Any, ...]]:
    """The span sink's reading of one record (``billing.span_sink``)."""
    return span_rows(decode_spans(value))


def measure_sync(args: argparse.Namespace) -> dict[str, Any]:
    from billing.storage import ClickHouseStore

    home = Path(tempfile.mkdtemp(prefix="tracing-work-"))
    settings = Settings(home=home, trace_flush_interval_s=1.0)
    if getattr(args, "gather_s", None):
        settings = settings.model_copy(update={"span_gather_s": args.gather_s})
    services = Services(settings)
    store = ClickHouseStore("chdb://memory")
    arms: dict[str, list[dict[str, float]]] = {"traced": [], "untraced": []}
    spans: dict[str, int] = {"traced": 0, "untraced": 0}
    loop = asyncio.new_event_loop()
    one_arm(
        services, store, True, 300, loop, args.requests_per_s
    )  # warm-up: imports, caches, the table
    one_arm(services, store, False, 300, loop, args.requests_per_s)
    for round_index in range(args.rounds):
        order = ("traced", "untraced") if round_index % 2 == 0 else ("untraced", "traced")
        for arm in order:
            cpu, num_spans = one_arm(
                services, store, arm == "traced", args.requests, loop, args.requests_per_s
            )
            arms[arm].append({k: 1e6 * v / args.requests for k, v in cpu.items()})
            spans[arm] += num_spans
    loop.close()
    shutil.rmtree(home, ignore_errors=True)
    per_request: dict[str, Any] = {}
    for arm, rounds in arms.items():
        totals = [sum(r.values()) for r in rounds]
        per_request[arm] = {
            **{stage: _median([r[stage] for r in rounds]) for stage in STAGES},
            "total": _median(totals),
            "total_min": round(min(totals), 1),
            "total_max": round(max(totals), 1),
        }
    added = [
        sum(on.values()) - sum(off.values())
        for on, off in zip(arms["traced"], arms["untraced"], strict=True)
    ]
    added_us = _median(added)
    result: dict[str, Any] = {
        "per_request_us": per_request,
        "added_us_per_request": added_us,
        "added_us_per_request_min": round(min(added), 1),
        "added_us_per_request_max": round(max(added), 1),
        "spans_per_traced_request": round(spans["traced"] / (args.rounds * args.requests), 2),
        "span_gather_s": settings.span_gather_s,
        "tokens_per_request": args.tokens,
        "added_us_per_token": round(added_us / args.tokens, 2),
    }
    if args.per_token_us:
        result["share_of_tokenbus_cpu_pct"] = round(
            100 * added_us / args.tokens / args.per_token_us, 2
        )
        result["tokenbus_us_per_token"] = args.per_token_us
    return result


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return round(ordered[middle], 1)
    return round((ordered[middle - 1] + ordered[middle]) / 2, 1)


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    load_start = uptime_load()
    figures = await asyncio.to_thread(measure_sync, args)
    return {
        "command": "python -m bench.tracing_work " + " ".join(args.argv),
        "parameters": {
            "requests": args.requests,
            "rounds": args.rounds,
            "tokens": args.tokens,
            "requests_per_s": args.requests_per_s,
            "per_token_us": args.per_token_us,
            "gather_s": args.gather_s,
        },
        "load_start": load_start,
        "load_end": uptime_load(),
        **figures,
    }


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(title="tracing's own work, CPU µs per request (median of rounds)")
    table.add_column("arm")
    for stage in (*STAGES, "total"):
        table.add_column(stage, justify="right")
    for arm, figures in result["per_request_us"].items():
        table.add_row(arm, *(f"{figures[s]:.1f}" for s in (*STAGES, "total")))
    console.print(table)
    line = (
        f"added: {result['added_us_per_request']} µs/request "
        f"({result['added_us_per_request_min']}..{result['added_us_per_request_max']}), "
        f"{result['added_us_per_token']} µs/token at {result['tokens_per_request']} tokens"
    )
    if "share_of_tokenbus_cpu_pct" in result:
        share, base = result["share_of_tokenbus_cpu_pct"], result["tokenbus_us_per_token"]
        line += f" = {share}% of {base} µs/token"
    console.print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="per arm and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    parser.add_argument(
        "--requests-per-s",
        type=int,
        default=50,
        help="the stack's request rate: how many requests a flush and an insert carry",
    )
    parser.add_argument(
        "--per-token-us",
        type=float,
        default=None,
        help="tokenbus CPU µs per token untraced (bench.tracing_cost), for the share",
    )
    parser.add_argument(
        "--gather-s",
        type=float,
        default=None,
        help="the span sink's span_gather_s (default: the setting's)",
    )
    run_benchmark(parser, argv, measure, render, "tracing_work")


if __name__ == "__main__":
    main()
