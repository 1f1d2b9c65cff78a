"""The cost of a LoRA adapter on the tiny model, on the worker's own engine (no Kafka):
TTFT and tokens/s without LoRA, with LoRA on but no adapter, and with an adapter; and
the first load of an adapter.

Runs in the worker environment (vLLM), with the stack worker's settings:

    .venvs/worker/bin/python -m bench.lora --runs 5

Each arm runs ``--runs`` times: one request alone (its TTFT), then ``--concurrency``
requests at once (their output tokens over the wall time). First loads are timed on
fresh adapters (``AdapterBook.ensure``, as the worker loads them), and the TTFT of a
request that has to load its adapter against one whose adapter is held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import exit_on_sigterm, print_table
from tokenbus.config import Settings
from tokenbus_cli.stack import REPO_ROOT, Stack
from workers.adapters import AdapterBook
from workers.interface import AdapterRef, GenerateOptions, GenerateParams
from workers.tiny_adapter import RANK

RESULT = REPO_ROOT / ".tokenbus" / "bench" / "lora.json"
PROMPT = "The consumer group rebalances when a member joins, and the partitions move"


async def _one(engine: Any, rid: str, n: int, adapter: AdapterRef | None) -> tuple[float, int]:
    params = GenerateParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    ttft = None
    count = 0
    async for delta in engine.generate(rid, PROMPT, params, GenerateOptions(adapter=adapter)):
        if delta.token_ids and ttft is None:
            ttft = time.perf_counter() - started
        count += len(delta.token_ids)
    return (ttft or 0.0) * 1000, count


async def _arm(
    engine: Any, name: str, adapter: AdapterRef | None, args: argparse.Namespace
) -> dict[str, Any]:
    ttfts, rates = [], []
    await _one(engine, f"{name}-warm", 8, adapter)
    for run in range(args.runs):
        ttft, _ = await _one(engine, f"{name}-{run}-alone", args.max_tokens, adapter)
        ttfts.append(ttft)
        started = time.perf_counter()
        done = await asyncio.gather(
            *(
                _one(engine, f"{name}-{run}-{i}", args.max_tokens, adapter)
                for i in range(args.concurrency)
            )
        )
        rates.append(sum(n for _, n in done) / (time.perf_counter() - started))
    return {"arm": name, "ttft_ms": ttfts, "tokens_per_s": rates}


async def _first_loads(engine: Any, refs: list[AdapterRef]) -> dict[str, Any]:
    book = AdapterBook(engine)
    loads, cold_ttft, warm_ttft = [], [], []
    for ref in refs:
        # A request that finds its adapter missing: the load and the request, as served.
        await book.ensure(ref)
        assert book.last_load_ms is not None
        ttft, _ = await _one(engine, f"cold-{ref.name}", 4, ref)
        cold_ttft.append(book.last_load_ms + ttft)
        loads.append(book.last_load_ms)
        warm, _ = await _one(engine, f"warm-{ref.name}", 4, ref)
        warm_ttft.append(warm)
    return {"first_load_ms": loads, "cold_ttft_ms": cold_ttft, "warm_ttft_ms": warm_ttft}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from workers.vllm_engine import VllmEngine

    stack = Stack(Settings(home=REPO_ROOT / ".tokenbus"))
    model = stack.build_model()
    names = [f"bench-lora-{n}" for n in range(args.runs + 1)]
    paths = stack.build_adapters(names)
    from tokenbus.tenants import lora_int_id

    refs = [AdapterRef(n, str(paths[n]), lora_int_id(n, str(paths[n]))) for n in names]
    settings = Settings(model_path=model, max_num_seqs=64, kv_cache_gib=0.25, max_model_len=2048)
    results: dict[str, Any] = {"arms": [], "rank": RANK, "runs": args.runs}
    for max_loras in (0, 1):
        lora = settings.model_copy(
            update={"max_loras": max_loras, "max_cpu_loras": len(refs), "max_lora_rank": RANK}
        )
        engine = VllmEngine.from_settings(lora)
        started = time.perf_counter()
        await engine.start()
        results[f"engine_start_s_max_loras_{max_loras}"] = time.perf_counter() - started
        try:
            if max_loras == 0:
                results["arms"].append(await _arm(engine, "LoRA off", None, args))
                continue
            results["arms"].append(await _arm(engine, "LoRA on, base model", None, args))
            results["loads"] = await _first_loads(engine, refs[1:])
            results["arms"].append(await _arm(engine, "LoRA on, adapter", refs[0], args))
        finally:
            await engine.shutdown()
    return results


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    results = asyncio.run(_measure(args))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    Path(RESULT).write_text(json.dumps(results, indent=2) + "\n")
    rows = [
        (arm["arm"], _spread(arm["ttft_ms"]), _spread(arm["tokens_per_s"]))
        for arm in results["arms"]
    ]
    loads = results["loads"]
    rows.append(("first load of an adapter", _spread(loads["first_load_ms"]), ""))
    rows.append(("TTFT, adapter to load", _spread(loads["cold_ttft_ms"]), ""))
    rows.append(("TTFT, adapter held", _spread(loads["warm_ttft_ms"]), ""))
    columns = ("arm", "TTFT ms, median (min-max)", f"tokens/s at {args.concurrency}")
    print_table(f"LoRA rank {RANK} on the tiny model", columns, rows, RESULT)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
