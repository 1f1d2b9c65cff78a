"""``bench/summary.json``: each goal's figure, from result JSONs of committed code.

    python -m bench.summary collect admission [--runs 3] [--lock FILE] [-- --requests 5000]
    python -m bench.summary collect admission [...] -- --counted-by job --name admission_job_counts
    python -m bench.summary build [--runs 3]

``collect`` runs one benchmark script N times, one run after the other; with ``--lock``
each run holds that file's lock alone and releases it before the next. ``build`` takes,
for each benchmark, its newest runs that were measured on one commit with a clean tree
(at most ``--runs``), and writes every figure's median and min..max over them, with the
load average the runs started under, and each goal's verdict. ``python -m bench.markdown
--update BENCHMARKS.md`` renders the goals table and the capacity model from it.

Figures are per machine. The same code's CPU per unit moved by a factor of two between
the development VMs these scripts have run on, so ``build`` summarises only the runs of
the machine the newest run was on (its CPU model and count, in every result's
``machine``), and keeps an earlier summary of another machine whole, under
``other_machines``. ``python -m bench.machine`` measures the floors that tell the
machines apart; the goals table shows them with each machine.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bench.capacity import relay_tokens_per_record
from bench.report import RESULTS_DIR
from bench.stats import added_ttft_ms, spread

SUMMARY_PATH = Path(__file__).resolve().parent / "summary.json"
MIN_RUNS = 3
"""Fewer runs than this make a figure provisional: the goals table says so."""

Result = dict[str, Any]

_STAMPED = re.compile(r"^(?P<name>[a-z_]+)-\d{8}-\d{6}\.json$")


def _first_row(result: Result, **match: Any) -> dict[str, Any] | None:
    """The first row of ``result["results"]`` whose fields equal ``match``."""
    for row in result.get("results", []):
        if all(row.get(k) == v for k, v in match.items()):
            return dict(row)
    return None


def _per_core(us: float | None) -> float | None:
    return 1e6 / us if us else None


# --- what each benchmark's result holds -------------------------------------------------

RELAY_ROW = {"tokens_per_step": 1, "num_tenants": 10}
BRIDGE_ROW = {"concurrency": 64, "event_loop": "uvloop"}
HOP_FETCH_MAX_WAIT_MS = 20
"""``Settings.fetch_max_wait_ms``: what the client, the bridge and the worker fetch with."""
TOKENBUS_PROCESSES = ("stream_job", "worker_loop", "client", "billing")
PROCESS_NAMES = {
    "stream_job": "job",
    "worker_loop": "worker loop",
    "client": "client",
    "billing": "billing",
    "broker": "broker",
}


def _admission(field: str) -> Callable[[Result], float | None]:
    def extract(result: Result) -> float | None:
        row = _first_row(result)
        if row is None:
            return None
        if field == "job_us_per_request":
            return 1e6 * float(row["cpu_s"]["stream_job"]) / max(1, int(row["num_forwarded"]))
        if field == "request_record_bytes":
            return float(row["request_bytes"]) + float(row["header_bytes"])
        return float(row[field])

    return extract


def _median(*keys: str) -> Callable[[Result], float | None]:
    """The median of the spread at ``keys`` in one run (a floor arm's under
    ``us_per_request``, ``bench.admit_work``'s ``traced`` or ``tracing``); None in a run
    made before it was."""

    def extract(result: Result) -> float | None:
        figure: Any = result
        for key in keys:
            figure = figure.get(key) if isinstance(figure, dict) else None
        return None if figure is None else float(figure["median"])

    return extract


def _relay_us(side: str) -> Callable[[Result], float | None]:
    def extract(result: Result) -> float | None:
        row = _first_row(result, **RELAY_ROW)
        return None if row is None else float(row["us_per_token"][side])

    return extract


def _relay_tokens_per_record(result: Result) -> float | None:
    row = _first_row(result, **RELAY_ROW)
    if row is None:
        return None
    return relay_tokens_per_record(
        int(row["concurrency"]), int(row["num_tenants"]), int(row["tokens_per_step"])
    )


def _overhead(concurrency: int, pick: Callable[[dict[str, Any]], Any]) -> Callable[[Result], Any]:
    def extract(result: Result) -> float | None:
        row = _first_row(result, concurrency=concurrency)
        if row is None:
            return None
        value = pick({**row, "hop_floor": result.get("hop_floor")})
        return None if value is None else float(value)

    return extract


def _us_per_token(row: dict[str, Any], parts: Iterable[str]) -> float:
    """s per 1k tokens --> µs per token (x 1000)."""
    by_part = row["pipeline_cpu_s_per_1k_tokens_by_part"]
    return 1000 * sum(float(by_part[p]) for p in parts)


def _parts_us(parts: Iterable[str]) -> Callable[[dict[str, Any]], float]:
    chosen = tuple(parts)
    return lambda row: _us_per_token(row, chosen)


def _idle_us(parts: Iterable[str]) -> Callable[[dict[str, Any]], float | None]:
    """The processes' idle CPU over the wave's time, per token (``bench.overhead``'s
    ``us_cpu_per_token_idle_by_process``; None in runs written before it)."""
    chosen = tuple(parts)

    def pick(row: dict[str, Any]) -> float | None:
        idle = row.get("us_cpu_per_token_idle_by_process")
        if not idle or any(p not in idle for p in chosen):
            return None
        return sum(float(idle[p]) for p in chosen)

    return pick


def _added_ttft(q: str) -> Callable[[dict[str, Any]], Any]:
    """Recomputed from each run's arms (``bench.overhead.added_ttft_ms``), so runs written
    before the measure was set against the direct arm's median read the same way."""
    return lambda row: added_ttft_ms(row["tokenbus"]["ttft_ms"], row["direct"]["ttft_ms"]).get(q)


def _leg(name: str, q: str) -> Callable[[dict[str, Any]], Any]:
    return lambda row: row["ttft_breakdown_ms"][name].get(q)


def _path(part: str) -> Callable[[dict[str, Any]], Any]:
    """p50 ms of a part of ``bench.overhead``'s path spans; None in a run without them."""
    return lambda row: (row.get("path_spans_ms") or {}).get(part, {}).get("p50")


def _hop(q: str) -> Callable[[Result], float | None]:
    def extract(result: Result) -> float | None:
        row = _first_row(result, fetch_max_wait_ms=HOP_FETCH_MAX_WAIT_MS)
        return None if row is None else float(row["hop_ms"][q])

    return extract


def _pick_slope(result: Result) -> float | None:
    """µs a pick costs per live worker of its model: between the fewest and the most
    workers ``bench.route_cost`` timed."""
    rows = sorted(result.get("results", []), key=lambda row: int(row["num_workers"]))
    if len(rows) < 2 or rows[-1]["num_workers"] == rows[0]["num_workers"]:
        return None
    fewest, most = rows[0], rows[-1]
    rise = float(most["us_per_pick"]["median"]) - float(fewest["us_per_pick"]["median"])
    return rise / (int(most["num_workers"]) - int(fewest["num_workers"]))


@dataclass(frozen=True)
class Figure:
    key: str
    benchmark: str
    """The result file's ``benchmark``: what ``python -m bench.<script>`` wrote."""
    label: str
    unit: str
    extract: Callable[[Result], float | None]


FIGURES: tuple[Figure, ...] = (
    Figure(
        "admission.requests_per_job_core_s",
        "admission",
        "admission, requests/s per job core",
        "req/s",
        _admission("requests_per_core_s"),
    ),
    Figure(
        "admission.job_us_per_request",
        "admission",
        "job CPU per request",
        "µs",
        _admission("job_us_per_request"),
    ),
    Figure(
        "admission_job_counts.job_us_per_request",
        "admission_job_counts",
        "job CPU per request, the job counting each prompt (a program's records)",
        "µs",
        _admission("job_us_per_request"),
    ),
    Figure(
        "admission.broker_us_per_request",
        "admission",
        "broker CPU per request (admission)",
        "µs",
        _admission("broker_cpu_ms_per_1k"),
    ),
    Figure(
        "admission.request_record_bytes",
        "admission",
        "request record, value and headers",
        "B",
        _admission("request_record_bytes"),
    ),
    Figure(
        "faust_floor.forward_us_per_request",
        "faust_floor",
        "floor: a Faust agent that only forwards, CPU per request",
        "µs",
        _median("us_per_request", "forward"),
    ),
    Figure(
        "faust_floor.ledger_us_per_request",
        "faust_floor",
        "floor: a Faust agent that forwards and writes one ledger record, CPU per request",
        "µs",
        _median("us_per_request", "ledger"),
    ),
    Figure(
        "faust_floor.aiokafka_ledger_us_per_request",
        "faust_floor",
        "floor without Faust: aiokafka forwards a batch and writes one keyed record each, "
        "CPU per request",
        "µs",
        _median("us_per_request", "aiokafka_ledger"),
    ),
    Figure(
        "admit_work.traced_us_per_request",
        "admit_work",
        "the job's own work without Faust and the broker (bench.admit_work), CPU per request",
        "µs",
        _median("traced"),
    ),
    Figure(
        "admit_work.tracing_us_per_request",
        "admit_work",
        "of that work, tracing (bench.admit_work: traced less untraced)",
        "µs",
        _median("tracing"),
    ),
    Figure(
        "route_cost.us_per_pick_per_worker",
        "route_cost",
        "a pick of a worker, job CPU per live worker of the model (bench.route_cost)",
        "µs",
        _pick_slope,
    ),
    Figure(
        "relay.worker_loop_tokens_per_core_s",
        "relay",
        "relay, worker loop tokens/s per core",
        "tok/s",
        lambda r: _per_core(_relay_us("worker_loop")(r)),
    ),
    Figure(
        "relay.client_tokens_per_core_s",
        "relay",
        "relay, client tokens/s per core",
        "tok/s",
        lambda r: _per_core(_relay_us("client")(r)),
    ),
    Figure(
        "relay.worker_loop_us_per_token",
        "relay",
        "worker loop CPU per token",
        "µs",
        _relay_us("worker_loop"),
    ),
    Figure(
        "relay.broker_us_per_token",
        "relay",
        "broker CPU per token at one token per record",
        "µs",
        _relay_us("broker"),
    ),
    Figure(
        "relay.tokens_per_record",
        "relay",
        "tokens per reply record in the relay run (estimated)",
        "tokens",
        _relay_tokens_per_record,
    ),
    Figure(
        "bridge.tokens_per_core_s",
        "bridge",
        "bridge tokens/s per core",
        "tok/s",
        lambda r: _float((_first_row(r, **BRIDGE_ROW) or {}).get("bridge_tokens_per_core_s")),
    ),
    Figure(
        "billing.events_per_core_s",
        "billing",
        "billing sink events/s per core",
        "events/s",
        lambda r: _float((_first_row(r) or {}).get("events_per_core_s")),
    ),
    Figure(
        "billing.us_system_per_event",
        "billing",
        "of the sink's CPU, the kernel's per event",
        "µs",
        lambda r: _float((_first_row(r) or {}).get("us_system_per_event")),
    ),
    Figure(
        "billing.minor_faults_per_event",
        "billing",
        "the sink's minor page faults per event",
        "faults",
        lambda r: _float((_first_row(r) or {}).get("minor_faults_per_event")),
    ),
    Figure(
        "e2e.tokenbus_us_per_token",
        "overhead",
        "c=64: job + worker loop + client + billing CPU per token",
        "µs",
        _overhead(64, _parts_us(TOKENBUS_PROCESSES)),
    ),
    *(
        Figure(
            f"e2e.{part}_us_per_token",
            "overhead",
            f"c=64: {PROCESS_NAMES[part]} CPU per token",
            "µs",
            _overhead(64, _parts_us([part])),
        )
        for part in (*TOKENBUS_PROCESSES, "broker")
    ),
    Figure(
        "e2e.tokenbus_idle_us_per_token",
        "overhead",
        "c=64: of which the job, worker loop and billing spend idle (same run)",
        "µs",
        _overhead(64, _idle_us(("stream_job", "worker_loop", "billing"))),
    ),
    Figure(
        "e2e.throughput_ratio",
        "overhead",
        "c=64: tokens/s, tokenbus over direct (same run)",
        "x",
        _overhead(64, lambda row: (row.get("ratios") or {}).get("throughput")),
    ),
    Figure(
        "e2e.vip_reserve",
        "overhead",
        "c=64: share of the seats held back for class 0 (vip_reserve; 0.3 before it was set)",
        "",
        lambda r: _float((r.get("parameters") or {}).get("vip_reserve", 0.3)),
    ),
    Figure(
        "e2e.pipeline_s_per_1k_tokens",
        "overhead",
        "c=64: whole pipeline CPU (with the broker) per 1k tokens",
        "s",
        _overhead(64, lambda row: row["pipeline_cpu_s_per_1k_tokens"]),
    ),
    *(
        Figure(
            f"ttft.added_{q}_ms",
            "overhead",
            f"c=1: added TTFT {q}",
            "ms",
            _overhead(1, _added_ttft(q)),
        )
        for q in ("p50", "p99", "max")
    ),
    Figure(
        "ttft.num_requests",
        "overhead",
        "c=1: requests the percentiles are taken over",
        "requests",
        _overhead(1, lambda row: row["tokenbus"].get("num_requests")),
    ),
    Figure(
        "ttft.direct_p50_ms",
        "overhead",
        "c=1: direct vLLM TTFT p50",
        "ms",
        _overhead(1, lambda row: row["direct"]["ttft_ms"]["p50"]),
    ),
    *(
        Figure(
            f"ttft.{leg}_{q}_ms",
            "overhead",
            f"c=1: {label} {q}",
            "ms",
            _overhead(1, _leg(leg, q)),
        )
        for leg, label in (
            ("client_to_dispatched", "client → job dispatched"),
            ("dispatched_to_worker_first_token", "dispatched → worker's first token"),
            ("worker_first_token_to_client", "worker's first token → client"),
        )
        for q in ("p50", "p99")
    ),
    *(
        Figure(
            f"ttft.{key}_p50_ms",
            "overhead",
            f"c=1: {label} p50",
            "ms",
            _overhead(1, _path(part)),
        )
        for key, part, label in (
            ("job_spans", "job", "the job's own spans on the path (admit, queue)"),
            ("job_to_worker_hop", "bus.dispatch", "job → worker hop (the worker's span)"),
            ("worker_own_spans", "worker_own", "the worker's own spans on the path (intake, emit)"),
        )
    ),
    Figure(
        "ttft.hop_floor_p50_ms",
        "overhead",
        "one broker hop p50 (process to process), same run",
        "ms",
        _overhead(1, lambda row: (row["hop_floor"] or {}).get("hop_ms", {}).get("p50")),
    ),
    Figure(
        "hop.p50_ms", "hop", "one broker hop p50, process to process (bench.hop)", "ms", _hop("p50")
    ),
    Figure(
        "hop.p99_ms", "hop", "one broker hop p99, process to process (bench.hop)", "ms", _hop("p99")
    ),
)


def _machine(field: str, side: str | None = None) -> Callable[[Result], float | None]:
    """A floor of ``bench.machine``: ``field``'s median, of the ``side`` round trip if given."""

    def extract(result: Result) -> float | None:
        row = _first_row(result)
        if row is None:
            return None
        found = row.get(side) if side else row
        return None if not found else _float(found[field]["median"])

    return extract


MACHINE_FIGURES: tuple[Figure, ...] = (
    Figure(
        "machine.cross_core_cpu_us",
        "machine",
        "a wakeup across cores, one side's CPU per round trip",
        "µs",
        _machine("cpu_us", "cross_core"),
    ),
    Figure(
        "machine.cross_core_wall_us",
        "machine",
        "a round trip across cores, wall",
        "µs",
        _machine("wall_us", "cross_core"),
    ),
    Figure(
        "machine.same_core_cpu_us",
        "machine",
        "the same on one core, CPU",
        "µs",
        _machine("cpu_us", "same_core"),
    ),
    Figure(
        "machine.idle_wake_cpu_us",
        "machine",
        "a wakeup across cores from idle (the other side sleeps 0.5 ms), CPU",
        "µs",
        _machine("cpu_us", "idle_wake"),
    ),
    Figure(
        "machine.syscall_ns", "machine", "a system call (getppid)", "ns", _machine("syscall_ns")
    ),
    Figure(
        "machine.python_us",
        "machine",
        "a fixed piece of pure Python (bench.machine)",
        "µs",
        _machine("python_us"),
    ),
    Figure(
        "machine.direct_tokens_per_s",
        "overhead",
        "the engine alone at c=64 (the direct arm), tokens/s",
        "tok/s",
        _overhead(64, lambda row: row["direct"].get("tokens_per_s")),
    ),
)
"""The machine's floors, shown in the heading of its goals table: the same code's figures
move with them from one machine to the next."""
FIGURES = FIGURES + MACHINE_FIGURES
FIGURES_BY_KEY = {f.key: f for f in FIGURES}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class Goal:
    key: str
    title: str
    figure: str
    op: Literal[">=", "<="]
    target: float
    beside: tuple[str, ...] = ()
    """Figures shown with the goal's: its parts, and the floor it is measured against."""


GOALS: tuple[Goal, ...] = (
    Goal(
        "admission",
        "admission ≥ 5,000 requests/s per job core (≤ 200 µs job CPU per request)",
        "admission.requests_per_job_core_s",
        ">=",
        5_000,
        (
            "admission.job_us_per_request",
            "admission_job_counts.job_us_per_request",
            "faust_floor.forward_us_per_request",
            "faust_floor.ledger_us_per_request",
            "faust_floor.aiokafka_ledger_us_per_request",
            "admit_work.traced_us_per_request",
            "admit_work.tracing_us_per_request",
        ),
    ),
    Goal(
        "relay_worker_loop",
        "relay ≥ 50,000 tokens/s per core: worker loop (1 token/step, 10 tenants)",
        "relay.worker_loop_tokens_per_core_s",
        ">=",
        50_000,
    ),
    Goal(
        "relay_client",
        "relay ≥ 50,000 tokens/s per core: client (1 token/step, 10 tenants)",
        "relay.client_tokens_per_core_s",
        ">=",
        50_000,
    ),
    Goal(
        "relay_bridge",
        "relay ≥ 50,000 tokens/s per core: SSE bridge (c=64, uvloop)",
        "bridge.tokens_per_core_s",
        ">=",
        50_000,
    ),
    Goal(
        "billing",
        "billing ingest ≥ 100,000 events/s on one core",
        "billing.events_per_core_s",
        ">=",
        100_000,
        ("billing.us_system_per_event", "billing.minor_faults_per_event"),
    ),
    Goal(
        "e2e_tokenbus",
        "c=64: tokenbus processes (job, worker loop, client, billing) ≤ 30 µs CPU per token",
        "e2e.tokenbus_us_per_token",
        "<=",
        30,
        (
            *(f"e2e.{p}_us_per_token" for p in TOKENBUS_PROCESSES),
            "e2e.tokenbus_idle_us_per_token",
            "e2e.throughput_ratio",
            "e2e.vip_reserve",
        ),
    ),
    Goal(
        "e2e_pipeline",
        "c=64: whole pipeline with the broker ≤ 0.10 s CPU per 1k tokens",
        "e2e.pipeline_s_per_1k_tokens",
        "<=",
        0.10,
        ("e2e.broker_us_per_token",),
    ),
    Goal(
        "ttft_p50",
        "c=1: added TTFT ≤ 10 ms at p50",
        "ttft.added_p50_ms",
        "<=",
        10,
        (
            "ttft.client_to_dispatched_p50_ms",
            "ttft.dispatched_to_worker_first_token_p50_ms",
            "ttft.worker_first_token_to_client_p50_ms",
            "ttft.direct_p50_ms",
            "ttft.job_spans_p50_ms",
            "ttft.job_to_worker_hop_p50_ms",
            "ttft.worker_own_spans_p50_ms",
            "ttft.hop_floor_p50_ms",
        ),
    ),
    Goal(
        "ttft_p99",
        "c=1: added TTFT ≤ 40 ms at p99",
        "ttft.added_p99_ms",
        "<=",
        40,
        (
            "ttft.num_requests",
            "ttft.added_max_ms",
            "ttft.client_to_dispatched_p99_ms",
            "ttft.dispatched_to_worker_first_token_p99_ms",
            "ttft.worker_first_token_to_client_p99_ms",
            "ttft.hop_floor_p50_ms",
        ),
    ),
)


# --- choosing runs and summarising them ------------------------------------------------


def is_clean(result: Result) -> bool:
    """Measured on a known commit with no tracked file changed (``bench.report``)."""
    machine = result.get("machine", {})
    return machine.get("dirty") is False and machine.get("commit") not in (None, "?")


def started_at(result: Result) -> str:
    return str(result.get("load_start", {}).get("at", ""))


UNRECORDED = "not recorded"
"""The machine key of a result, or of a summary, written before they named their machine."""


def machine_key(result: Result) -> str:
    """What tells machines apart here: the CPU's model name and the number of CPUs."""
    machine = result.get("machine", {})
    cpu, num_cpus = machine.get("cpu"), machine.get("num_cpus")
    return f"{cpu}, {num_cpus} CPUs" if cpu and cpu != "?" else UNRECORDED


MACHINE_FIELDS = ("cpu", "num_cpus", "mem_gib", "kernel", "python")
"""What a summary keeps of the machine its runs were on."""


def machine_of(result: Result) -> dict[str, Any]:
    """The machine a result ran on, as a summary names it."""
    machine = result.get("machine", {})
    return {"key": machine_key(result), **{k: machine.get(k) for k in MACHINE_FIELDS}}


def newest_machine(results: Mapping[str, Sequence[Result]]) -> Result | None:
    """The newest clean result of any benchmark: its machine is the summary's."""
    clean = [r for rs in results.values() for r in rs if is_clean(r)]
    return max(clean, key=started_at, default=None)


def select_runs(
    results: Sequence[Result], max_runs: int, machine: str | None = None
) -> list[Result]:
    """The newest clean runs of one benchmark that share the newest clean run's commit,
    on ``machine`` (a ``machine_key``) if given."""
    clean = sorted(
        (r for r in results if is_clean(r) and machine in (None, machine_key(r))),
        key=started_at,
        reverse=True,
    )
    if not clean:
        return []
    commit = clean[0]["machine"]["commit"]
    return [r for r in clean if r["machine"]["commit"] == commit][:max_runs]


def summarize_figure(figure: Figure, runs: Sequence[Result]) -> dict[str, Any] | None:
    """Median and min..max of ``figure`` over ``runs``, with their commit, dates, loads."""
    measured = [(r, v) for r in runs if (v := figure.extract(r)) is not None]
    if not measured:
        return None
    values = [v for _, v in measured]
    loads = [float(r["load_start"]["load_1_5_15"][0]) for r, _ in measured]
    dates = sorted(started_at(r) for r, _ in measured)
    return {
        "label": figure.label,
        "unit": figure.unit,
        "benchmark": figure.benchmark,
        **spread(values),
        "num_runs": len(values),
        "values": [round(v, 3) for v in values],
        "commit": measured[0][0]["machine"]["commit"],
        "date": dates[-1],
        "dates": dates,
        "load_1min": spread(loads),
        "sources": [str(r.get("source", "")) for r, _ in measured],
    }


def verdict(op: str, target: float, value: float | None) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= target if op == ">=" else value <= target) else "not met"


def summarize_goal(goal: Goal, figures: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    figure = figures.get(goal.figure)
    median = None if figure is None else float(figure["median"])
    return {
        "key": goal.key,
        "title": goal.title,
        "figure": goal.figure,
        "op": goal.op,
        "target": goal.target,
        "unit": FIGURES_BY_KEY[goal.figure].unit,
        "verdict": verdict(goal.op, goal.target, median),
        "num_runs": 0 if figure is None else figure["num_runs"],
        "commit": None if figure is None else figure["commit"],
        "date": None if figure is None else figure["date"],
        "load_1min": None if figure is None else figure["load_1min"],
        "beside": [k for k in goal.beside if k in figures],
    }


def build_summary(
    results: Mapping[str, Sequence[Result]],
    *,
    max_runs: int = MIN_RUNS,
    record_bytes: Mapping[str, float] | None = None,
    generated_at: str = "",
    earlier: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary of ``results`` (benchmark name --> its result JSONs) on the machine of
    the newest clean run; other machines' runs are left out. A benchmark with no result
    on that machine keeps its figures from ``earlier`` (the summary this one replaces) if
    ``earlier`` was of the same machine, each with the commit, date and load it was
    measured at: a machine that ran only some of the scripts does not drop the others'
    figures. An ``earlier`` of another machine is kept whole in ``other_machines``, with
    those it kept: figures of two machines never share a table."""
    newest = newest_machine(results)
    earlier = earlier or {}
    earlier_machine = earlier.get("machine") or {"key": UNRECORDED}
    machine = earlier_machine if newest is None else machine_of(newest)
    same = bool(earlier) and earlier_machine["key"] == machine["key"]
    runs = {name: select_runs(rs, max_runs, machine["key"]) for name, rs in results.items()}
    kept: Mapping[str, dict[str, Any]] = earlier.get("figures", {}) if same else {}
    figures: dict[str, dict[str, Any]] = {}
    for figure in FIGURES:
        if runs.get(figure.benchmark):
            found = summarize_figure(figure, runs[figure.benchmark])
        else:
            found = kept.get(figure.key)
        if found is not None:
            figures[figure.key] = found
    others = [m for m in earlier.get("other_machines", []) if m["machine"]["key"] != machine["key"]]
    if earlier and not same:
        others.insert(
            0,
            {
                "machine": earlier_machine,
                "generated_at": earlier.get("generated_at", ""),
                "goals": earlier.get("goals", []),
                "figures": earlier.get("figures", {}),
            },
        )
    return {
        "generated_at": generated_at,
        "min_runs": MIN_RUNS,
        "machine": machine,
        "goals": [summarize_goal(goal, figures) for goal in GOALS],
        "figures": figures,
        "record_bytes": dict(record_bytes or {}),
        "other_machines": others,
    }


# --- I/O: result files, record sizes, running the scripts -------------------------------


def load_results(directory: Path) -> dict[str, list[Result]]:
    """Every stamped result file (``<benchmark>-YYYYmmdd-HHMMSS.json``) by benchmark."""
    found: dict[str, list[Result]] = {}
    for path in sorted(directory.glob("*.json")):
        match = _STAMPED.match(path.name)
        if match is None:
            continue
        result = json.loads(path.read_text())
        if result.get("benchmark") != match["name"]:
            continue
        found.setdefault(match["name"], []).append({**result, "source": path.name})
    return found


def record_bytes() -> dict[str, float]:
    """Encoded sizes of the records the capacity model counts, from ``schemas``: a reply
    record (a ``TokenChunkBatch``) of one and of eight one-token chunks, and a usage event."""
    from datetime import UTC, datetime

    from schemas import TokenChunk, TokenChunkBatch, UsageEvent, UsageStatus, encode

    def batch(num_chunks: int) -> int:
        chunks = [
            TokenChunk(
                request_id=f"req_{i:024d}",
                tenant_id="tenant-0001",
                seq=17,
                text=" word",
                token_ids=[12345],
                num_tokens=1,
            )
            for i in range(num_chunks)
        ]
        return len(encode(TokenChunkBatch(tenant_id="tenant-0001", chunks=chunks)))

    now = datetime(2026, 1, 1, tzinfo=UTC)
    usage = UsageEvent(
        request_id=f"req_{0:024d}",
        session_id=f"sess_{0:024d}",
        tenant_id="tenant-0001",
        model="llama-3.1-8b-instruct",
        worker_id="worker-0001",
        status=UsageStatus.OK,
        num_prompt_tokens=1000,
        num_completion_tokens=275,
        queue_ms=3.2,
        ttft_ms=41.5,
        total_ms=5200.0,
        created_at=now,
        finished_at=now,
        last_seq=274,
    )
    one, eight = batch(1), batch(8)
    return {
        "reply_record_one_chunk": one,
        "reply_record_per_extra_chunk": round((eight - one) / 7, 1),
        "usage_event": len(encode(usage)),
    }


def collect(script: str, runs: int, lock: Path | None, extra: Sequence[str]) -> list[Path]:
    """Runs ``python -m bench.<script> <extra>`` ``runs`` times; each run under ``lock``
    alone. Returns the result files the runs wrote."""
    written: list[Path] = []
    for i in range(runs):
        before = set(RESULTS_DIR.glob("*.json"))
        argv = [sys.executable, "-m", f"bench.{script}", *extra]
        print(f"run {i + 1}/{runs}: {' '.join(argv)}", flush=True)
        if lock is None:
            subprocess.run(argv, check=True)
        else:
            with lock.open("a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                try:
                    subprocess.run(argv, check=True)
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)
        written += sorted(
            p
            for p in set(RESULTS_DIR.glob("*.json")) - before
            if _STAMPED.match(p.name) is not None
        )
    return written


def split_script_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``collect``'s own options, and the script's (everything after ``--``)."""
    if "--" not in argv:
        return list(argv), []
    cut = list(argv).index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("collect", help="run one benchmark script N times")
    run.add_argument(
        "script",
        help="admission, admit_work, relay, billing_ingest, overhead, bridge, hop, route_cost, "
        "machine",
    )
    run.add_argument("--runs", type=int, default=MIN_RUNS)
    run.add_argument("--lock", type=Path, help="a lock file each run holds (and releases)")
    build = commands.add_parser("build", help="write bench/summary.json from the results")
    build.add_argument("--runs", type=int, default=MIN_RUNS, help="newest runs per benchmark")
    build.add_argument("--results", type=Path, default=RESULTS_DIR)
    build.add_argument("--out", type=Path, default=SUMMARY_PATH)
    build.add_argument(
        "--fresh",
        action="store_true",
        help="drop the figures of benchmarks with no result here, and other machines' "
        "(default: keep --out's)",
    )
    ours, extra = split_script_args(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(ours)
    if args.command == "collect":
        for path in collect(args.script, args.runs, args.lock, extra):
            print(f"wrote {path}")
        return
    summary = build_summary(
        load_results(args.results),
        max_runs=args.runs,
        record_bytes=record_bytes(),
        generated_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        earlier=None if args.fresh or not args.out.exists() else json.loads(args.out.read_text()),
    )
    args.out.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(f"machine: {summary['machine']['key']}")
    for goal in summary["goals"]:
        figure = summary["figures"].get(goal["figure"])
        shown = "-" if figure is None else f"{figure['median']} {goal['unit']}"
        print(f"{goal['verdict']:>12}  {shown:>16}  {goal['title']}")
    for other in summary["other_machines"]:
        print(f"kept: the summary of {other['machine']['key']} ({other['generated_at']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
