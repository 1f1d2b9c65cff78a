"""What vLLM on the CPU keeps using after its last step: the direct arm's engine (the
worker's own ``VllmEngine``, as ``bench.overhead`` runs it) idle, then one wave, then
each process's CPU in short windows after the wave's end.

vLLM on the CPU always runs its model in a worker process of its own (the CPU platform
turns the uniprocess executor into the multiprocess one), which reads each step from a
shared-memory queue and, for one second after its last read, spins on ``sched_yield``
before it waits on a socket (``SpinCondition.busy_loop_s`` in vLLM's ``shm_broadcast``).
This measures that second; ``bench.overhead`` pauses past it between its arms.

    .venvs/stream/bin/python -m bench.engine_spin
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
from pathlib import Path
from typing import Any

from rich.table import Table

from bench.common import bench_settings, exit_on_sigterm, make_console, model_dir
from bench.direct_arm import DirectProcess
from bench.procstat import CpuMeter, descendants
from bench.report import uptime_load, write_result
from bench.workload import prompts, tenant


def process_names(pid: int) -> dict[str, list[int]]:
    """The direct arm's process tree by each process's name (``comm``)."""
    names: dict[str, list[int]] = {}
    for each in (pid, *descendants(pid)):
        try:
            name = Path(f"/proc/{each}/comm").read_text().strip()
        except OSError:
            continue
        names.setdefault(name, []).append(each)
    return names


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    load_start = uptime_load()
    settings = bench_settings(model_path=model_dir())
    settings.home.mkdir(parents=True, exist_ok=True)
    direct = DirectProcess(settings, settings.home / "direct.log")
    try:
        await direct.ready()
        groups = process_names(direct.pid)
        meter = CpuMeter(groups)
        meter.start()
        await asyncio.sleep(args.window_s * args.windows)
        idle = meter.delta()
        await direct.wave(prompts(0, args.requests), 1, args.max_tokens, tenant(0))
        after: list[dict[str, float]] = []
        for _ in range(args.windows):
            meter.start()
            await asyncio.sleep(args.window_s)
            after.append(meter.delta())
    finally:
        direct.stop()
        shutil.rmtree(settings.home, ignore_errors=True)
    idle_s = args.window_s * args.windows
    return {
        "parameters": vars(args),
        "load_start": load_start,
        "load_end": uptime_load(),
        "processes": sorted(groups),
        "idle_before_cores": cores(idle, idle_s),
        "cores_after_wave": [
            {"from_s": round(i * args.window_s, 2), **cores(window, args.window_s)}
            for i, window in enumerate(after)
        ],
    }


def cores(cpu_s: dict[str, float], wall_s: float) -> dict[str, float]:
    return {name: round(used / wall_s, 3) for name, used in cpu_s.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16, help="in the one wave, at c=1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window-s", type=float, default=0.5)
    parser.add_argument("--windows", type=int, default=6, help="after the wave (and before)")
    args = parser.parse_args()
    exit_on_sigterm()
    console = make_console()
    with console.status("starting the direct arm's engine, then one wave"):
        result = asyncio.run(measure(args))
    path = write_result("engine_spin", result)
    table = Table(title="cores each process of the direct arm used after its last step")
    names = result["processes"]
    for column in ("window", *names):
        table.add_column(column, justify="right")
    before = result["idle_before_cores"]
    table.add_row("idle, before the wave", *(f"{before.get(n, 0.0):.2f}" for n in names))
    for window in result["cores_after_wave"]:
        start = window["from_s"]
        table.add_row(
            f"{start:.1f}-{start + args.window_s:.1f} s after",
            *(f"{window.get(n, 0.0):.2f}" for n in names),
        )
    console.print(table)
    console.print(f"[dim]load {result['load_start']['load_1_5_15']}; wrote {path}[/]")


if __name__ == "__main__":
    main()
