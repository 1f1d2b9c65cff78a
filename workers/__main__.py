"""``tokenbus-worker`` / ``python -m workers``: one vLLM worker serving one model.

Configuration comes from ``TOKENBUS_*`` variables (see tokenbus.config.Settings).
SIGTERM or SIGINT drains: running requests finish, nothing new is taken.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import orjson

from tokenbus import loops
from tokenbus.config import Settings
from tokenbus.heap import freeze_startup_heap
from tokenbus.logs import logging_config, setup_logging
from workers.worker import Worker

log = logging.getLogger("workers")


async def _serve(settings: Settings) -> None:
    from workers.vllm_engine import VllmEngine  # imports vLLM: worker environment only

    engine = VllmEngine.from_settings(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("starting engine for %s from %s", settings.served_model_name, settings.model_dir)
    await engine.start()
    freeze_startup_heap("worker", settings.gc_gen0_threshold)
    try:
        await Worker(settings, engine).run(stop)
    finally:
        await engine.shutdown()


def _vllm_logs_as_ours(settings: Settings) -> None:
    """vLLM configures logging in each of its processes (this one and the engine core it
    spawns) from ``VLLM_LOGGING_CONFIG_PATH``: give it ours, so its lines are JSON too."""
    path = settings.home / "logs" / "worker-logging.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(logging_config(settings)))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)


def main() -> int:
    settings = Settings()
    setup_logging(settings)
    if settings.log_format == "json":
        _vllm_logs_as_ours(settings)
    if not settings.model_dir.exists():
        print(f"error: no model at {settings.model_dir}", file=sys.stderr)
        return 2
    loops.run(_serve(settings), settings)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    sys.exit(main())
