"""What every benchmark script shares: settings on free ports, ``--set`` overrides, rich."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench.report import write_result
from tokenbus import loops
from tokenbus.config import Settings
from tokenbus_cli.stack import REPO_ROOT, Stack, free_port

UNLIMITED_TPM = 10**12
"""Benchmarks measure throughput, not the quota: no tenant may be refused."""


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, CI) unwinds like Ctrl-C, so ``finally`` stops the services."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a tokenbus Settings field for this run, e.g. --set linger_ms=1",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's TOKENBUS_HOME")
    parser.add_argument(
        "--client-loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="the event loop of the benchmark's own process, a client of the stack "
        "(the services' loop is --set event_loop=...)",
    )


def usable_cpu(text: str) -> int:
    """An argument that must name a CPU this process may run on (``sched_getaffinity``)."""
    usable = sorted(os.sched_getaffinity(0))
    try:
        cpu = int(text)
    except ValueError:
        cpu = -1
    if cpu not in usable:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a CPU this machine lets the benchmark use "
            f"({', '.join(map(str, usable))})"
        )
    return cpu


def add_pin_job_arg(parser: argparse.ArgumentParser) -> None:
    """``--pin-job CPU [CPU ...]``: the CPUs every thread of the Faust job is pinned to
    once it is up (``bench.procstat.pin_threads``); none by default, as the stack runs it."""
    parser.add_argument(
        "--pin-job",
        type=usable_cpu,
        nargs="+",
        default=[],
        metavar="CPU",
        help="pin every thread of the Faust job to these CPUs once it is up (default: unpinned)",
    )


def at_least_one(text: str) -> int:
    """An argument that must be a whole number of 1 or more (a count, a wait in ms)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for pair in pairs:
        name, _, raw = pair.partition("=")
        try:
            overrides[name.strip()] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            overrides[name.strip()] = raw  # a bare string such as acks=all
    return overrides


def model_dir() -> Path:
    """The tiny model, built once into the repository's own cache (as the tests do)."""
    return Stack(Settings(home=REPO_ROOT / ".tokenbus")).build_model()


def bench_settings(home: Path | None = None, **overrides: Any) -> Settings:
    """A private stack: its own home, broker port and query port, and no quota limits.

    It has a service secret of its own, which every service the benchmark starts (the
    job, the bridge) and its ``TokenbusClient``s share, so the client mints service
    tokens for the tenants it names; and since benchmarks name many tenants that no
    tenants file lists, unlisted tenants are served (on the unlimited defaults)."""
    fields: dict[str, Any] = {
        "home": home or Path(tempfile.mkdtemp(prefix="tokenbus-bench-")),
        "default_tpm": UNLIMITED_TPM,
        "default_rpm": UNLIMITED_TPM,
        "client_timeout_s": 60,
        "bus_service_secret": secrets.token_urlsafe(32),
        "allow_unlisted_tenants": True,
        "broker_profile": "tansu",  # every benchmark runs the bundled broker
    }
    # Every listening port a service has (broker, billing queries, bridge, ...): free
    # ones, so a benchmark never meets another engineer's stack on the defaults.
    for name, info in Settings.model_fields.items():
        if name.endswith("_port") and info.default is not None:
            fields[name] = free_port()
    fields.update(overrides)
    return Settings(**fields)


def make_console() -> Console:
    """Wide enough for the tables even when the output is a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=150)


def progress(console: Console) -> Progress:
    # A slow refresh: the client's own CPU is part of what the benchmarks measure.
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        refresh_per_second=2,
    )


def progress_task(bar: Progress, description: str, total: int) -> Callable[[int], None]:
    """A task on ``bar``, and the callback that sets how much of it is done."""
    task = bar.add_task(description, total=total)
    return lambda done: bar.update(task, completed=done)


def print_table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], path: Path
) -> None:
    """A benchmark's result table, right-aligned, and where its JSON was written."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    console = make_console()
    console.print(table)
    console.print(f"written to {path}")


def profiled_name(stage: str) -> Callable[[argparse.Namespace], str]:
    """``run_benchmark``'s ``name`` for a stage benchmark: ``--name``, else the stage, with
    ``-profile`` when ``--profile`` ran it under py-spy."""
    return lambda args: args.name or (f"{stage}-profile" if args.profile else stage)


def run_benchmark(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    measure: Callable[[argparse.Namespace, Console], Coroutine[Any, Any, dict[str, Any]]],
    render: Callable[[dict[str, Any], Console], None],
    name: str | Callable[[argparse.Namespace], str] | None = None,
) -> None:
    """A benchmark's ``main``: parse (keeping the argv for the result's command), run
    ``measure`` (SIGTERM ends it like Ctrl-C), write the result JSON (named ``name``, or
    what ``name`` makes of the arguments, or the ``--name`` argument), show it."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    exit_on_sigterm()
    console = make_console()
    # The benchmark's own process is a client of the stack (TokenbusClient, the direct
    # arm's HTTP client): on uvloop, as the services are and as the README advises a
    # busy client, unless ``--client-loop asyncio``.
    loop = Settings.model_validate({"event_loop": getattr(args, "client_loop", "uvloop")})
    result = loops.run(measure(args, console), loop)
    path = write_result(name(args) if callable(name) else name or args.name, result)
    render(result, console)
    console.print(f"[dim]wrote {path}[/]")
