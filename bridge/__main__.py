"""``python -m bridge``: serve the bridge with uvicorn on ``bridge_host:bridge_port``.

Configuration comes from ``TOKENBUS_*`` variables (see tokenbus.config.Settings).
SIGTERM or SIGINT stops accepting, lets open responses end, then deletes the reply topic.
"""

from __future__ import annotations

import sys

import uvicorn

from bridge.app import create_app
from tokenbus.config import Settings
from tokenbus.heap import freeze_startup_heap
from tokenbus.logs import setup_logging

GRACEFUL_SHUTDOWN_S = 10


def main() -> int:
    settings = Settings()
    setup_logging(settings)
    app = create_app(settings)
    freeze_startup_heap("bridge", settings.gc_gen0_threshold)
    uvicorn.run(
        app,
        host=settings.bridge_host,
        port=settings.bridge_port,
        loop=settings.event_loop,  # uvicorn's names for the same two loops
        log_level="info",
        log_config=None,  # uvicorn's loggers reach the root handler setup_logging made
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
