"""Traces across the bus, on the real stack: one request through the bridge is one trace
with spans from the bridge, the job, the worker and billing, correctly parented, found by
``tokenbus trace``'s query in tokenbus's own store (no collector), and by the query
server's live view, whose slowest-requests table links to the request's trace page. The
spans on the path to the first token tile it, for every request: they add up to the TTFT
the caller measured, from its ``X-Request-Start`` to its host's kernel receiving the first
event (``sse_caller``: the caller's own wake-up after that is no span's to see)."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta
from html import unescape
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from billing.reader import open_reader
from billing.traces import TRACE_SQL
from tests.integration.conftest import BridgeProcess, bridge_key, eventually
from tests.integration.sse_caller import FirstEvent, SseCaller
from tokenbus.config import Settings

MODEL = "tiny-llama"
TENANT = "br-trace"  # no other test's: its slowest requests of the last minutes are these
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SERVICES = {"tokenbus-bridge", "tokenbus-job", "tokenbus-worker", "tokenbus-billing"}


def spans_of(settings: Settings, request_id: str) -> list[dict[str, Any]]:
    reader = open_reader(settings)
    try:
        return reader.query(TRACE_SQL, {"tenant": TENANT, "request_id": request_id})
    finally:
        reader.close()


TTFT_PATH = (
    "bridge.arrival",
    "bridge.auth",
    "bridge.hygiene",
    "bridge.admission_wait",
    "bridge.first_event",
)
"""The bridge's spans from the caller's ``X-Request-Start`` to the first event written."""
ADMISSION_PATH = (
    "bus.request",
    "job.admit",
    "job.queue",
    "bus.dispatch",
    "worker.intake",
    "worker.engine_input",
    "worker.engine_queue",
    "worker.prefill",
    "worker.emit",
    "bus.reply",
)
"""The spans of the bus, the job and the worker that tile ``bridge.admission_wait``."""
TRACED_REQUESTS = 3


async def traced_request(
    caller: SseCaller, body: dict[str, Any], headers: dict[str, str]
) -> FirstEvent:
    """One streamed completion; its TTFT ends where the kernel received the first event
    (``sse_caller``), its start is the ``X-Request-Start`` the caller stamps as a front
    end would."""
    first = await asyncio.to_thread(caller.post, "/v1/chat/completions", body, headers)
    assert first.status == 200 and first.stamped, first
    return first


def path_ms(named: dict[str, dict[str, Any]], path: tuple[str, ...]) -> float:
    """The path's spans' durations, summed (ms), once each starts where the one before
    ended (to the µs the table keeps: starts to the µs, durations truncated to it)."""
    for before, after in itertools.pairwise(path):
        end = started(named[before]) + timedelta(microseconds=named[before]["duration_us"])
        gap_us = (started(named[after]) - end) / timedelta(microseconds=1)
        assert abs(gap_us) <= 2, f"{before} -> {after}: {gap_us} µs apart"
    total_ms: float = sum(named[name]["duration_us"] / 1000 for name in path)
    return total_ms


def started(span: dict[str, Any]) -> datetime:
    start = span["start_time"]  # through the query server, datetimes arrive as text
    return datetime.fromisoformat(start) if isinstance(start, str) else start


async def check_tiling(settings: Settings, first: FirstEvent) -> None:
    """The bridge's path spans add up to the caller's TTFT within 5 ms, and the spans of
    the bus, the job and the worker tile the bridge's admission wait."""
    request_id, ttft_ms = first.request_id, first.ttft_ms
    spans = await eventually(
        lambda: spans_of(settings, request_id),
        timeout_s=30,
        until=lambda rows: {*TTFT_PATH, *ADMISSION_PATH} <= {r["name"] for r in rows},
    )
    named = by_name(spans)
    assert abs(path_ms(named, TTFT_PATH) - ttft_ms) <= 5.0, (first, spans)
    waited_ms = named["bridge.admission_wait"]["duration_us"] / 1000
    assert abs(path_ms(named, ADMISSION_PATH) - waited_ms) <= 0.01, (request_id, spans)
    assert started(named["bus.request"]) == started(named["bridge.admission_wait"])


def by_name(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    named: dict[str, dict[str, Any]] = {}
    for span in spans:
        assert span["name"] not in named, f"two {span['name']} spans: {spans}"
        named[span["name"]] = span
    return named


async def test_one_bridge_request_is_one_trace_across_four_services(
    bridge: BridgeProcess, settings: Settings
) -> None:
    headers = {
        "Authorization": f"Bearer {bridge_key(TENANT)}",
        "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "trace me"}],
        "max_tokens": 6,
        "stream": True,
        # The tiny random model, 512 tokens of vocabulary at temperature 1, sometimes
        # samples its end of sequence early: the worker's span is checked against 6.
        "ignore_eos": True,
    }
    url = urlsplit(bridge.url)
    assert url.hostname is not None and url.port is not None
    caller = await asyncio.to_thread(SseCaller, url.hostname, url.port)
    try:
        # A request first, so the traced one finds its connection open, as a client's
        # second request does.
        await traced_request(caller, body, {"Authorization": headers["Authorization"]})
        # Up to the first token, the spans tile the time the caller waited: every
        # request's, each in a trace of its own.
        measured = [await traced_request(caller, body, headers)]
        for n in range(TRACED_REQUESTS - 1):
            again = {**headers, "traceparent": f"00-{CALLER_TRACE[:-1]}{n}-{CALLER_SPAN}-01"}
            measured.append(await traced_request(caller, body, again))
    finally:
        caller.close()
    request_id = measured[0].request_id
    for first in measured:
        await check_tiling(settings, first)

    spans = await eventually(
        lambda: spans_of(settings, request_id),
        timeout_s=30,
        until=lambda rows: SERVICES <= {r["service"] for r in rows},
    )
    assert {span["trace_id"] for span in spans} == {CALLER_TRACE}
    named = by_name(spans)
    ids = {name: span["span_id"] for name, span in named.items()}

    def parent(name: str) -> str:
        return str(named[name]["parent_span_id"])

    # The caller's span is honoured; every service's span hangs under the one before.
    assert parent("bridge.request") == CALLER_SPAN
    for child in (*TTFT_PATH, "bridge.relay"):
        assert parent(child) == ids["bridge.request"], child
    # Each hop of the bus is a sibling of the span that took the record, made by the
    # service that took it.
    for child in ("bus.request", "job.admit", "bus.reply"):
        assert parent(child) == ids["bridge.admission_wait"], child
    assert parent("job.queue") == ids["job.admit"]
    for child in ("bus.dispatch", "worker.request"):
        assert parent(child) == ids["job.queue"], child
    for phase in [name for name in ADMISSION_PATH if name.startswith("worker.")]:
        assert parent(phase) == ids["worker.request"], phase
    assert parent("worker.decode") == ids["worker.request"]
    hops = {name: named[name]["service"] for name in ("bus.request", "bus.dispatch", "bus.reply")}
    assert hops == {
        "bus.request": "tokenbus-job",
        "bus.dispatch": "tokenbus-worker",
        "bus.reply": "tokenbus-bridge",
    }
    assert parent("billing.insert") == ids["worker.request"]
    assert {named[n]["service"] for n in ("job.admit", "job.queue")} == {"tokenbus-job"}
    request = named["worker.request"]
    assert request["request_id"] == request_id and request["attempt"] == 0
    assert request["attributes"]["tokenbus.tenant"] == TENANT
    assert int(request["attributes"]["tokenbus.num_completion_tokens"]) == 6

    # `tokenbus trace` prints the same trace, with no collector.
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tokenbus_cli.cli", "trace", request_id, "--tenant", TENANT],
        env=_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"trace {CALLER_TRACE}"
    assert any("worker.decode" in line and "tokenbus-worker" in line for line in lines)
    assert any("billing.insert" in line for line in lines)

    # The live view's slowest requests of this tenant hold it (its row is stored: the
    # billing.insert span is), linked to a trace page with every service's spans.
    live_url = f"http://127.0.0.1:{settings.billing_query_port}/live?tenant={TENANT}&limit=100"
    async with httpx.AsyncClient(timeout=30) as http:
        live = await http.get(live_url)
        assert live.status_code == 200, live.text
        mine = re.escape(f"<tr><td>{TENANT}</td><td>{request_id}</td>")
        row = re.search(f"{mine}.*?</tr>", live.text)
        assert row is not None, live.text
        link = re.search(r'<a href="([^"]+)">trace</a>', row[0])
        assert link is not None, row[0]
        page = await http.get(urljoin(live_url, unescape(link[1])))
    assert page.status_code == 200, page.text
    assert f"request {request_id} of tenant {TENANT}" in page.text
    assert f"<h2>trace {CALLER_TRACE}</h2>" in page.text
    for name in ("bridge.request", "job.admit", "worker.decode", "billing.insert"):
        assert f"{name}</td>" in page.text, name
    for service in SERVICES:
        assert f"<td>{service}</td>" in page.text, service


def _env(settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "TOKENBUS_HOME": str(settings.home),
        "TOKENBUS_CLICKHOUSE_DSN": settings.clickhouse,
        "TOKENBUS_BILLING_QUERY_PORT": str(settings.billing_query_port),
    }
