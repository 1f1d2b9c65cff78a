"""Prints the latest results as the Markdown tables BENCHMARKS.md keeps.

    .venvs/stream/bin/python -m bench.markdown [goals capacity overhead admission ...]
    .venvs/stream/bin/python -m bench.markdown --update BENCHMARKS.md [goals capacity ...]

The goals table and the capacity model come from ``bench/summary.json`` (``python -m
bench.summary build``); every other table from ``bench/results/<name>-latest.json``, so
the document shows the figures the scripts wrote, not figures copied by hand.
``--update`` rewrites every block between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` in the file; a block whose source file is absent keeps its text.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import capacity as cap
from bench.report import RESULTS_DIR
from bench.summary import SUMMARY_PATH, UNRECORDED


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _context(result: dict[str, Any]) -> str:
    start, end = result["load_start"], result["load_end"]
    return (
        f"_{start['at']}, git {result['machine']['git']}, load (1/5/15 min) "
        f"{start['load_1_5_15']} at start, {end['load_1_5_15']} at end._"
    )


def overhead(result: dict[str, Any]) -> str:
    rows = []
    for r in result["results"]:
        d, t = r["direct"], r["tokenbus"]
        rows.append(
            [
                r["concurrency"],
                f"{d['ttft_ms']['p50']:.1f} / {t['ttft_ms']['p50']:.1f}",
                f"{d['ttft_ms']['p99']:.1f} / {t['ttft_ms']['p99']:.1f}",
                f"**{r['added_ttft_ms']['p50']:.1f}** / **{r['added_ttft_ms']['p99']:.1f}**",
                f"{d['itl_ms']['mean']:.2f} / {t['itl_ms']['mean']:.2f}",
                f"{d['itl_ms']['p50']:.2f} / {t['itl_ms']['p50']:.2f}",
                f"{d['itl_ms']['p99']:.1f} / {t['itl_ms']['p99']:.1f}",
                f"{d['tokens_per_s']:.0f} / {t['tokens_per_s']:.0f}",
                f"**{r['ratios']['throughput']:.2f}**",
                f"{r['pipeline_cpu_s_per_1k_tokens']:.3f}",
            ]
        )
    header = [
        "conc",
        "TTFT p50 direct / bus (ms)",
        "TTFT p99 direct / bus (ms)",
        "added TTFT p50 / p99 (ms)",
        "ITL mean (ms)",
        "ITL p50 (ms)",
        "ITL p99 (ms)",
        "tokens/s direct / bus",
        "throughput ratio",
        "pipeline CPU s / 1k tokens",
    ]
    parts = []
    for r in result["results"]:
        by = r["pipeline_cpu_s_per_1k_tokens_by_part"]
        b = r["ttft_breakdown_ms"]
        parts.append(
            [
                r["concurrency"],
                *(
                    f"{by[k]:.3f}"
                    for k in ("broker", "stream_job", "billing", "client", "worker_loop")
                ),
                *(str(b[k].get("p50", "-")) for k in b),
            ]
        )
    header2 = [
        "conc",
        "broker",
        "Faust job",
        "billing",
        "client",
        "worker loop",
        "client -> dispatched p50 ms",
        "dispatched -> worker 1st token p50 ms",
        "worker -> client p50 ms",
    ]
    idle = result["idle_stack_cores_during_direct"]
    blocks = [
        _context(result),
        _table(header, rows),
        "Pipeline CPU (s per 1k tokens) by process, and the tokenbus TTFT split by the "
        "worker's own timestamps:",
        _table(header2, parts),
        f"The idle stack (between its waves) burned {idle.get('p50', '-')} cores (p50).",
    ]
    floor = result.get("hop_floor")
    if floor:
        blocks.append(
            f"One hop through the same stack's broker after the waves (fetch_max_wait_ms "
            f"{floor['fetch_max_wait_ms']}): p50 {floor['hop_ms']['p50']:.2f} ms, p99 "
            f"{floor['hop_ms']['p99']:.2f} ms"
            + (
                f"; producer and consumer in lock-step in one process (the old measure), p50 "
                f"{floor['hop_in_process_ms']['p50']:.2f} ms."
                if "hop_in_process_ms" in floor
                else "."
            )
        )
    return "\n\n".join(blocks)


def admission(result: dict[str, Any]) -> str:
    rows = [
        [
            "{p50} / {p99}".format(**r["idle_latency_ms"]) if "idle_latency_ms" in r else "-",
            r["num_tenants"],
            r["num_workers"],
            r["prompt_tokens"],
            r["num_forwarded"],
            f"{r['requests_per_s']:.0f}",
            f"**{r['requests_per_core_s']:.0f}**",
            f"{1000 * r['cpu_s']['stream_job'] / max(1, r['num_forwarded']):.2f}",
            f"{r['broker_cpu_ms_per_1k'] / 1000:.2f}",
        ]
        for r in result["results"]
    ]
    header = [
        "idle latency p50 / p99 ms",
        "tenants",
        "workers",
        "prompt tokens",
        "requests",
        "req/s (wall)",
        "req/s per job core",
        "job CPU ms/req",
        "broker CPU ms/req",
    ]
    return _context(result) + "\n\n" + _table(header, rows)


def relay(result: dict[str, Any]) -> str:
    rows = [
        [
            r["tokens_per_step"],
            f"{r['tokens_per_s']:.0f}",
            f"{r['chunks_per_s']:.0f}",
            f"**{r['tokens_per_core_s']:.0f}**",
            f"{r['us_per_token']['worker_loop']:.1f}",
            f"{r['us_per_token']['broker']:.1f}",
            f"{r['us_per_token']['client']:.1f}",
            r["num_seq_gaps"],
        ]
        for r in result["results"]
    ]
    header = [
        "tokens per chunk",
        "tokens/s (wall)",
        "chunks/s",
        "tokens/s per core",
        "worker µs/token",
        "broker µs/token",
        "client µs/token",
        "seq gaps",
    ]
    return _context(result) + "\n\n" + _table(header, rows)


def billing(result: dict[str, Any]) -> str:
    rows = [
        [
            r["batch_rows"],
            r["num_tenants"],
            r["num_handled"],
            f"**{r['events_per_s']:.0f}**",
            f"{r['events_per_core_s']:.0f}",
            f"{r['sink_cpu_s'] / max(1e-9, r['wall_s']):.2f}",
        ]
        for r in result["results"]
    ]
    header = ["batch rows", "tenants", "events", "events/s", "events/s per core", "sink cores busy"]
    return _context(result) + "\n\n" + _table(header, rows)


def growth(result: dict[str, Any]) -> str:
    rows = []
    for r in result["results"]:
        c = r["cost"]
        parts = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("unit", "rate", "per_core"))
        rows.append(
            [
                r["stage"],
                f"{r['axis']} = {r['value']}",
                f"{c['rate']:.0f}",
                f"{c['per_core']:.0f}",
                f"per {c['unit']}: {parts}",
                r["load"]["load_1_5_15"][0],
            ]
        )
    header = ["stage", "point", "rate /s (wall)", "per core /s", "CPU per unit", "load 1 min"]
    return _context(result) + "\n\n" + _table(header, rows)


def load_table(result: dict[str, Any]) -> str:
    rows = []
    for r in result["results"]:
        cores = r["cpu_cores"]
        workers = sum(v for k, v in cores.items() if k.startswith("fake-"))
        rows.append(
            [
                r.get("kind", "-"),
                r["num_tenants"],
                f"{r['measured_offered_rps']:.0f}",
                f"{r['completed_rps']:.0f}",
                f"{r['ttft_ms'].get('p50', float('nan')):.0f}",
                f"**{r['ttft_ms'].get('p99', float('nan')):.0f}**",
                f"{r['e2e_ms'].get('p99', float('nan')):.0f}",
                sum(r["errors"].values()),
                f"{cores['stream_job']:.2f} / {cores['broker']:.2f} / {workers:.2f} / "
                f"{cores['client']:.2f}",
                "**broken**: " + ", ".join(r["broken"]) if r["broken"] else "ok",
            ]
        )
    header = [
        "point",
        "tenants",
        "offered req/s",
        "completed req/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "e2e p99 ms",
        "failed",
        "cores: job / broker / workers / client",
        "verdict",
    ]
    return _context(result) + "\n\n" + _table(header, rows)


def hop(result: dict[str, Any]) -> str:
    rows = [
        [
            r["fetch_max_wait_ms"],
            r.get("num_partitions", 1),
            r.get("pause_ms", 2),
            f"{r['hop_ms']['p50']:.2f}",
            f"{r['hop_ms']['p99']:.2f}",
            f"{r['hop_in_process_ms']['p50']:.2f}" if "hop_in_process_ms" in r else "-",
            f"{r['idle_broker_cores']:.3f}",
            f"{r['idle_consumer_cores']:.3f}",
        ]
        for r in result["results"]
    ]
    header = [
        "fetch_max_wait_ms",
        "partitions held",
        "mean pause before a record, ms",
        "hop p50 ms",
        "hop p99 ms",
        "lock-step in one process (the old measure): hop p50 ms",
        "idle broker cores",
        "idle consumer cores",
    ]
    return _context(result) + "\n\n" + _table(header, rows)


def fetch_cost(result: dict[str, Any]) -> str:
    rows = [
        [
            r["batches"],
            "on" if r.get("fetch_wait_rule") else "off",
            r["fetch_max_wait_ms"],
            r["tail_records"],
            f"{r['tail_ms']:.1f}",
            r["read_from_start"],
            f"{r['read_s']:.1f}",
        ]
        for r in result["results"]
    ]
    header = [
        "batches in the partition",
        "tokenbus.tansu.fetch_wait",
        "fetch_max_wait_ms",
        "tail fetch (10 behind): records",
        "tail fetch ms",
        "read from the start: records",
        "in s",
    ]
    return _context(result) + "\n\n" + _table(header, rows)


def _profile_table(title: str, profile: dict[str, Any], num_frames: int = 12) -> str:
    rows = [
        [own["pct"], f"`{own['frame']}`", incl["pct"], f"`{incl['frame']}`"]
        for own, incl in zip(
            profile["self"][:num_frames], profile["inclusive"][:num_frames], strict=False
        )
    ]
    header = ["self %", "frame (self)", "incl. %", "frame (inclusive)"]
    text = f"**{title}** ({profile['num_samples']} samples)\n\n" + _table(header, rows)
    if profile.get("by_package"):
        shares = ", ".join(f"{row['package']} {row['pct']}%" for row in profile["by_package"])
        text += f"\n\nSelf time by package: {shares}."
    return text


def _profiles(found: dict[str, Any], title: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each ``top_frames`` in ``found`` with its title: ``found`` is one, or a mapping of
    names (a side, an arm, a concurrency, a process) to them, nested to any depth."""
    if "self" in found:
        yield title, found
        return
    for name, inner in found.items():
        yield from _profiles(inner, f"{title}: {name}")


def profile(result: dict[str, Any]) -> str:
    """The py-spy top frames a ``--profile`` run recorded: each result's own, and what the
    run pooled over its results (``profiles``: by arm in ``bench.faust_floor``, by
    concurrency and process in ``bench.overhead``)."""
    found = [(r.get("profile") or {}) for r in result.get("results", [])]
    found.append(result.get("profiles") or {})
    blocks = [_context(result)]
    for each in found:
        if each:
            blocks += [_profile_table(t, p) for t, p in _profiles(each, result["benchmark"])]
    return "\n\n".join(blocks)


def bridge(result: dict[str, Any]) -> str:
    from bench.bridge import COLUMNS, table_rows

    return _context(result) + "\n\n" + _table(list(COLUMNS), table_rows(result["results"]))


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "hop": hop,
    "fetch_cost": fetch_cost,
    "profile": profile,
    "overhead": overhead,
    "admission": admission,
    "relay": relay,
    "bridge": bridge,
    "billing": billing,
    "growth": growth,
    "load_table": load_table,
}


def overhead_runs(kept: str = "") -> str:
    """Every overhead run kept in bench/results, one line each: the noise made visible.

    ``kept``, the block as the document has it: its rows of runs with no file here stay,
    in order of their runs. Results are not in the repository, so a fresh checkout would
    otherwise drop every run before its own."""
    rows: list[list[str]] = []
    for path in sorted(RESULTS_DIR.glob("overhead*-2*.json")):
        result = json.loads(path.read_text())
        if result.get("parameters", {}).get("rounds", 0) < 3:
            continue  # smoke runs
        if result.get("parameters", {}).get("prototypes"):
            continue  # measured with monkeypatched code that was never committed
        by_c = {r["concurrency"]: r for r in result["results"]}
        c1, c64 = by_c.get(1), by_c.get(64)
        if c1 is None or c64 is None:
            continue
        params = result["parameters"]
        variant = ", ".join(f"{k}={v}" for k, v in params.get("settings_overrides", {}).items())
        rows.append(
            [
                result["load_start"]["at"],
                variant or f"as is (git {result['machine']['git']})",
                f"{result['load_start']['load_1_5_15'][0]} -> "
                f"{result['load_end']['load_1_5_15'][0]}",
                f"{c1['added_ttft_ms']['p50']:.0f} / {c1['added_ttft_ms']['p99']:.0f}",
                f"{c64['added_ttft_ms']['p50']:.0f}",
                f"{c64['ratios']['throughput']:.2f}",
                f"{c1['pipeline_cpu_s_per_1k_tokens']:.2f}",
                f"{c64['pipeline_cpu_s_per_1k_tokens']:.3f}",
                f"{result['idle_stack_cores_during_direct'].get('p50', '-')}",
            ]
        )
    header = [
        "run",
        "variant",
        "load 1 min start -> end",
        "c=1 added TTFT p50 / p99 ms",
        "c=64 added TTFT p50 ms",
        "c=64 throughput ratio",
        "c=1 pipeline CPU s/1k tok",
        "c=64 pipeline CPU s/1k tok",
        "idle stack cores",
    ]
    here = {row[0] for row in rows}
    for line in kept.splitlines()[2:]:  # past the header and its rule
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == len(header) and cells[0] not in here:
            rows.append(cells)
    return _table(header, sorted(rows, key=lambda row: row[0]))


def _num(value: float) -> str:
    # Three places below 1: a goal of 0.10 must not read as met at a median of 0.105.
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


def _figure(figure: dict[str, Any], label: bool = False) -> str:
    """``median unit (min..max)``, optionally after its label."""
    text = f"{_num(figure['median'])} {figure['unit']}".rstrip()
    if figure["num_runs"] > 1:
        text += f" ({_num(figure['min'])}..{_num(figure['max'])})"
    return f"{figure['label']} {text}" if label else text


REPORTED = ("hop.p50_ms", "hop.p99_ms", "admission.broker_us_per_request")
"""Figures of no goal that the goals table still shows: the floor, the broker's share."""


MACHINE_FLOORS = (
    "machine.cross_core_cpu_us",
    "machine.cross_core_wall_us",
    "machine.same_core_cpu_us",
    "machine.idle_wake_cpu_us",
    "machine.syscall_ns",
    "machine.python_us",
    "machine.direct_tokens_per_s",
)
"""``bench.machine``'s floors and the engine's own speed: what sets one machine apart."""


def _machine_heading(entry: dict[str, Any], current: bool) -> str:
    machine = entry.get("machine") or {"key": UNRECORDED}
    if machine["key"] == UNRECORDED:
        name = "a machine this summary did not record (written before summaries named theirs)"
    else:
        kernel = f", kernel {machine['kernel']}" if machine.get("kernel") else ""
        name = f"`{machine['key']}`{kernel}"
    figures = entry["figures"]
    floors = "; ".join(_figure(figures[k], label=True) for k in MACHINE_FLOORS if k in figures)
    when = "" if current else f", kept from the summary of {entry['generated_at']}"
    return f"**On {name}**{when}." + (f" Its floors: {floors}." if floors else "")


def _goals_table(entry: dict[str, Any], min_runs: int) -> str:
    """One machine's goals: a row per goal, with the figures measured beside it."""
    figures = entry["figures"]
    rows = []
    for goal in entry["goals"]:
        figure = figures.get(goal["figure"])
        if figure is None:
            rows.append([goal["title"], "-", "-", "-", "-", "not measured"])
            continue
        load = goal["load_1min"]
        verdict = f"**{goal['verdict']}**"
        if goal["num_runs"] < min_runs:
            verdict += f" ({goal['num_runs']} of {min_runs} runs: provisional)"
        rows.append(
            [
                goal["title"],
                f"**{_figure(figure)}**, median of {goal['num_runs']}",
                f"{load['median']} ({load['min']}..{load['max']})"
                if goal["num_runs"] > 1
                else f"{load['median']}",
                f"`{goal['commit'][:10]}`, {goal['date']}",
                "; ".join(_figure(figures[k], label=True) for k in goal["beside"]) or "-",
                verdict,
            ]
        )
    header = ["goal", "measured", "load 1 min", "commit, last run", "beside it", "verdict"]
    also = [
        f"{_figure(figures[k], label=True)} (`{figures[k]['commit'][:10]}`, "
        f"load {figures[k]['load_1min']['median']})"
        for k in REPORTED
        if k in figures
    ]
    return _table(header, rows) + (
        "\n\nReported beside the goals: " + "; ".join(also) + "." if also else ""
    )


def goals(summary: dict[str, Any]) -> str:
    """The "Goals at a glance" tables of ``bench/summary.json``: the newest machine's,
    then each other machine's that the summary keeps."""
    parts = [
        f"_From `bench/summary.json` ({summary['generated_at']}): each figure is the median "
        f"of its benchmark's newest runs on one clean commit and one machine, min..max in "
        f"brackets._",
        _machine_heading(summary, current=True),
        _goals_table(summary, summary["min_runs"]),
    ]
    for other in summary.get("other_machines", []):
        parts += [_machine_heading(other, current=False), _goals_table(other, summary["min_runs"])]
    return "\n\n".join(parts)


def capacity(summary: dict[str, Any], rates: cap.GpuRates | None = None) -> str:
    """The capacity model worked from the summary's medians (``bench.capacity``)."""
    rates = rates or cap.GpuRates()
    costs, missing = cap.costs_from_summary(summary)
    if costs is None:
        return "_The capacity model needs these figures in `bench/summary.json`: " + (
            ", ".join(f"`{m}`" for m in missing) + "._"
        )
    per_gpu = cap.cores_per_gpu(costs, rates)
    fleets = [cap.fleet(costs, rates, num_gpus) for num_gpus in cap.FLEETS]
    worker_high = max(f.worker_loop_cores[1] / f.num_gpus for f in fleets)
    names = {"stream_job": "job", "bridge": "bridge", "billing": "billing"}
    lines = [
        f"_Worked from `bench/summary.json` ({summary['generated_at']}) by `bench/capacity.py`._",
        "",
        f"**Measured costs** (medians): job {_num(costs.job_us_per_request)} µs per request "
        f"with one worker, and {costs.pick_us_per_worker:.2f} µs more for each further live "
        "worker of the request's model (a pick reads them all); "
        f"billing sink {_num(costs.billing_us_per_event)} µs per event; bridge "
        f"{_num(costs.bridge_us_per_token)} µs per token; worker loop "
        f"{_num(costs.worker_loop_us_per_token)} and the bundled broker "
        f"{_num(costs.broker_us_per_token)} µs per token in a relay run whose reply records "
        f"carried ~{costs.relay_tokens_per_record:.1f} tokens each (estimated). Records: a "
        f"request {costs.request_record_bytes:.0f} B, a reply record "
        f"{costs.reply_record_bytes:.0f} B and {costs.reply_bytes_per_extra_chunk:.0f} B per "
        f"further chunk, a usage event {costs.usage_record_bytes:.0f} B.",
        "",
        f"**Per GPU** at {rates.tokens_per_s:,.0f} tokens/s and {rates.requests_per_s:.0f} "
        f"requests/s (an 8B model on an H100): "
        + ", ".join(f"{names[k]} {v:.3f} cores" for k, v in per_gpu.items())
        + " (the job's with one worker; the table's with the fleet's)"
        + f", and the worker loop up to {worker_high:.3f} cores (its own process, one per "
        "GPU: "
        + (
            "it keeps up)."
            if worker_high <= cap.INSTANCE_CORES
            else f"**it does not keep up** at more than {cap.INSTANCE_CORES} of a core)."
        ),
        "",
    ]
    rows = []
    for f in fleets:
        rows.append(
            [
                f.num_gpus,
                f"{f.num_gpus * rates.tokens_per_s:,.0f}",
                f"{f.num_gpus * rates.requests_per_s:,.0f}",
                *(
                    f"{f.cores[k]:.2f} ({f.instances[k]})"
                    for k in ("stream_job", "bridge", "billing")
                ),
                "{:.2f}..{:.2f}".format(*f.worker_loop_cores),
                f"{f.reply_records_per_s:,.0f}",
                f"{f.tokens_per_reply_record:.2f}",
                f"{f.records_per_s:,.0f}",
                f"{f.bytes_per_s / 1e6:.1f}",
                f"{f.reply_records_per_s_per_topic:,.0f}",
                f"{f.reply_mb_s_per_topic:.2f} ({100 * f.partition_share:.0f}%)",
                "{:.1f}..{:.1f}".format(*f.broker_cores_tansu),
            ]
        )
    header = [
        "GPUs",
        "tokens/s",
        "requests/s",
        "job cores (instances)",
        "bridge cores (instances)",
        "billing cores (instances)",
        "worker loop cores",
        "reply records/s",
        "tokens per reply record",
        "broker records/s",
        "broker MB/s in",
        "records/s per reply partition",
        f"MB/s per reply partition (of {cap.KAFKA_PARTITION_MB_S:.0f})",
        "bundled broker cores (replies)",
    ]
    lines.append(_table(header, rows))
    lines += [
        "",
        f"Assumptions: one decode step every {rates.step_ms:.0f} ms, so "
        f"{rates.num_running:.0f} requests run per GPU; {rates.num_tenants} tenants active; "
        "requests spread evenly over the bridges and tenants; the fleet serves one model, a "
        "worker per GPU, so each pick reads every GPU's worker (a fleet of several models "
        "reads fewer). A worker sends one reply "
        "record per engine step per (reply topic, tenant), so a record carries more than one "
        "token only where several running requests share a bridge and a tenant; with more "
        "bridges the records thin towards one token each. Instances run at "
        f"{cap.INSTANCE_CORES:.0%} of a core. The worker loop's and the broker's costs were "
        "measured per token at the relay's records; the table gives them as a range, from "
        "all per token to all per record at this table's records. Broker bytes count "
        "each record's value "
        "(requests twice: the requests topic and the worker topic; replies; usage), "
        "without headers or replication. The broker cores are the bundled broker's "
        "measured cost for the reply records; Apache Kafka's differs and is not measured here.",
        "",
        "Kafka's side: Confluent puts one partition's produce throughput at \"10s of "
        'MB/sec" and sizes a topic at max(t/p, t/c) partitions '
        "([5 common pitfalls when using Apache Kafka]"
        "(https://www.confluent.io/blog/5-common-pitfalls-when-using-apache-kafka/)); the "
        f"table checks each reply partition against the low end, {cap.KAFKA_PARTITION_MB_S:.0f}"
        " MB/s. Records/s per reply partition is the other figure to check: reply records "
        "are small, and a broker's cost is largely per record.",
    ]
    return "\n".join(lines)


SUMMARY_RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "goals": goals,
    "capacity": capacity,
}


def render(name: str, kind: str | None = None, current: str = "") -> str | None:
    """The block ``name``, or None when its source file is absent. ``current``: the
    block's text in the document now."""
    if name in SUMMARY_RENDERERS:
        if not SUMMARY_PATH.exists():
            return None
        return SUMMARY_RENDERERS[name](json.loads(SUMMARY_PATH.read_text()))
    if name == "overhead-runs":
        return overhead_runs(current)
    path = RESULTS_DIR / f"{name}-latest.json"
    if not path.exists():
        return None
    renderer = RENDERERS[kind or name.split("-")[0]]
    return renderer(json.loads(path.read_text()))


_BLOCK = re.compile(r"(<!-- bench:([\w.-]+)(?: kind=(\w+))? -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def update(document: Path, only: Sequence[str] = ()) -> int:
    """Rewrites the marked blocks of ``document`` (those named in ``only``, if any);
    returns how many it rewrote."""
    text = document.read_text()
    count = 0

    def fill(match: re.Match[str]) -> str:
        nonlocal count
        opening, name, kind, current, closing = match.groups()
        if only and name not in only:
            return match.group(0)
        text = render(name, kind, current)
        if text is None:
            return match.group(0)  # no source here: keep what the document has
        count += 1
        return f"{opening}{text}\n{closing}"

    document.write_text(_BLOCK.sub(fill, text))
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="blocks to print (or, with --update, rewrite)")
    parser.add_argument("--kind", help="renderer, when a name is not one (overhead-fetch100)")
    parser.add_argument("--update", type=Path, help="rewrite the marked blocks of this file")
    args = parser.parse_args()
    if args.update:
        print(f"rewrote {update(args.update, args.names)} blocks of {args.update}")
        return
    for name in args.names or [*SUMMARY_RENDERERS, *RENDERERS]:
        text = render(name, args.kind)
        print(f"<!-- {name} -->\n{text or '_no source file: run its benchmark first_'}\n")


if __name__ == "__main__":
    main()
