"""Prints the latest results as the Markdown tables BENCHMARKS.md keeps.

    .venvs/stream/bin/python -m bench.markdown [overhead admission relay ...]
    .venvs/stream/bin/python -m bench.markdown --update BENCHMARKS.md

Each table comes from ``bench/results/<name>-latest.json``, so the document shows the
figures the scripts wrote, not figures copied by hand. ``--update`` rewrites every
block between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in the file.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import RESULTS_DIR


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
    return "\n\n".join(
        [
            _context(result),
            _table(header, rows),
            "Pipeline CPU (s per 1k tokens) by process, and the tokenbus TTFT split by the "
            "worker's own timestamps:",
            _table(header2, parts),
            f"The idle stack (between its waves) burned {idle.get('p50', '-')} cores (p50).",
        ]
    )


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
    return f"**{title}** ({profile['num_samples']} samples)\n\n" + _table(header, rows)


def profile(result: dict[str, Any]) -> str:
    """The py-spy top frames a ``--profile`` run recorded."""
    blocks = [_context(result)]
    for r in result["results"]:
        found = r.get("profile") or {}
        if "self" in found:
            blocks.append(_profile_table(result["benchmark"], found))
        else:
            for side, prof in found.items():
                blocks.append(_profile_table(f"{result['benchmark']}: {side}", prof))
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


def overhead_runs() -> str:
    """Every overhead run kept in bench/results, one line each: the noise made visible."""
    rows = []
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
    return _table(header, rows)


def render(name: str, kind: str | None = None) -> str:
    if name == "overhead-runs":
        return overhead_runs()
    path = RESULTS_DIR / f"{name}-latest.json"
    if not path.exists():
        return f"_no results yet: run the script that writes {path.name}_"
    renderer = RENDERERS[kind or name.split("-")[0]]
    return renderer(json.loads(path.read_text()))


_BLOCK = re.compile(r"(<!-- bench:([\w.-]+)(?: kind=(\w+))? -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def update(document: Path) -> int:
    """Rewrites the marked blocks of ``document``; returns how many it rewrote."""
    text = document.read_text()
    count = 0

    def fill(match: re.Match[str]) -> str:
        nonlocal count
        count += 1
        opening, name, kind, _, closing = match.groups()
        return f"{opening}{render(name, kind)}\n{closing}"

    document.write_text(_BLOCK.sub(fill, text))
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", default=list(RENDERERS))
    parser.add_argument("--kind", help="renderer, when a name is not one (overhead-fetch100)")
    parser.add_argument("--update", type=Path, help="rewrite the marked blocks of this file")
    args = parser.parse_args()
    if args.update:
        print(f"rewrote {update(args.update)} blocks of {args.update}")
        return
    for name in args.names:
        print(f"<!-- {name}-latest.json -->\n{render(name, args.kind)}\n")


if __name__ == "__main__":
    main()
