"""``python -m bench.fake_worker``: the real worker loop (``workers.worker.Worker``) on
``bench.fake_engine.FakeEngine``. Settings from TOKENBUS_* as for ``python -m workers``;
the pretend engine's pace from BENCH_STEP_MS, BENCH_TOKENS_PER_STEP and
BENCH_PREFILL_MS_PER_1K (all default 0 / 1)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from bench.fake_engine import FakeEngine
from tokenbus import loops
from tokenbus.config import Settings
from workers.worker import Worker


async def _serve(settings: Settings) -> None:
    engine = FakeEngine(
        settings.served_model_name,
        settings.max_num_seqs,
        step_s=float(os.environ.get("BENCH_STEP_MS", "0")) / 1000,
        tokens_per_step=int(os.environ.get("BENCH_TOKENS_PER_STEP", "1")),
        prefill_s_per_1k_tokens=float(os.environ.get("BENCH_PREFILL_MS_PER_1K", "0")) / 1000,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await engine.start()
    try:
        await Worker(settings, engine).run(stop)
    finally:
        await engine.shutdown()


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = Settings()
    loops.run(_serve(settings), settings)


if __name__ == "__main__":
    main()
