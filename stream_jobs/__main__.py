"""``python -m stream_jobs``: runs one instance of the Faust job (add more to scale out)."""

from __future__ import annotations

import sys

import faust

from stream_jobs.app import create_app
from tokenbus import loops
from tokenbus.config import Settings
from tokenbus.logs import logging_config, setup_logging


def main() -> int:
    settings = Settings()
    setup_logging(settings, configure_root=False)
    loops.install_policy(settings)
    app = create_app(settings)
    worker = faust.Worker(app, loglevel="INFO", quiet=True, logging_config=logging_config(settings))
    worker.execute_from_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
