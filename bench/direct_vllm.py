"""The direct arm: the worker's own ``VllmEngine`` driven in-process, no Kafka at all.

Runs in the worker environment (vLLM), with the same Settings as the stack's worker:

    .venvs/worker/bin/python -m bench.direct_vllm --concurrency 1 16 64

prints one JSON document per wave. ``bench.overhead`` instead starts it with
``--serve``: it then reads JSON commands on stdin and answers each on ``--result-fd``
(a pipe of its own, because vLLM logs to stdout), so the two arms can alternate while
both engines stay loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import IO, Any

from bench.driver import run_wave
from bench.procstat import cpu_seconds, descendants, runqueue_wait_seconds
from bench.workload import prompts, tenant
from tokenbus.config import Settings
from workers.interface import GenerateOptions, GenerateParams


def build_engine(settings: Settings) -> Any:
    """Exactly the engine ``python -m workers`` builds from the same settings."""
    from workers.vllm_engine import VllmEngine

    return VllmEngine.from_settings(settings)


class DirectArm:
    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._num_requests = 0

    def cpu(self) -> dict[str, float]:
        """This process (AsyncLLM front end + driver) and the engine core it spawned."""
        me = os.getpid()
        engine = descendants(me)
        return {
            "frontend": cpu_seconds(me),
            "engine": sum(cpu_seconds(pid) for pid in engine),
            "frontend_runqueue_wait": runqueue_wait_seconds(me),
            "engine_runqueue_wait": sum(runqueue_wait_seconds(pid) for pid in engine),
        }

    async def wave(self, command: dict[str, Any]) -> dict[str, Any]:
        params = GenerateParams(
            max_tokens=int(command["max_tokens"]),
            temperature=float(command.get("temperature", 0.0)),
            ignore_eos=True,
        )
        # The worker passes the tenant as cache salt; so does this arm.
        options = GenerateOptions(cache_salt=str(command.get("tenant", tenant(0))))

        async def stream(index: int, text: str) -> AsyncIterator[int]:
            self._num_requests += 1
            request_id = f"direct-{os.getpid()}-{self._num_requests}"
            async for delta in self._engine.generate(request_id, text, params, options):
                yield len(delta.token_ids)

        before = self.cpu()
        result = await run_wave(stream, command["prompts"], int(command["concurrency"]))
        after = self.cpu()
        return {
            "op": "wave",
            "wave": result.to_json(),
            "cpu": {name: round(after[name] - before[name], 3) for name in after},
        }


def _emit(out: IO[str], payload: dict[str, Any]) -> None:
    out.write(json.dumps(payload) + "\n")
    out.flush()


async def _serve(arm: DirectArm, out: IO[str]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or not line.strip():
            return
        command = json.loads(line)
        if command["op"] == "quit":
            return
        if command["op"] == "cpu":
            _emit(out, {"op": "cpu", "cpu": arm.cpu()})
        else:
            _emit(out, await arm.wave(command))


async def _main(args: argparse.Namespace) -> None:
    # vLLM logs to stdout: keep the real stdout for results, send everything else to stderr.
    result_fd = os.dup(1) if args.result_fd == 1 else args.result_fd
    os.dup2(2, 1)
    out = os.fdopen(result_fd, "w")
    engine = build_engine(Settings())
    await engine.start()
    arm = DirectArm(engine)
    try:
        _emit(out, {"op": "ready", "pid": os.getpid(), "engine_pids": descendants(os.getpid())})
        if args.serve:
            await _serve(arm, out)
            return
        for concurrency in args.concurrency:
            command = {
                "concurrency": concurrency,
                "prompts": prompts(0, args.num_requests or 2 * concurrency),
                "max_tokens": args.max_tokens,
            }
            result = await arm.wave(command)
            _emit(out, result)
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", action="store_true", help="take commands on stdin")
    parser.add_argument("--result-fd", type=int, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-requests", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
