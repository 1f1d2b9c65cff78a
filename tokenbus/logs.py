"""Logging for every tokenbus service: INFO everywhere, DEBUG for the loggers named in
``Settings.debug_loggers`` (``TOKENBUS_DEBUG_LOGGERS='["workers.replies"]'``)."""

from __future__ import annotations

import logging

from tokenbus.config import Settings

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(settings: Settings, *, configure_root: bool = True) -> None:
    """``configure_root=False`` where a framework (Faust) sets the handlers up itself."""
    if configure_root:
        logging.basicConfig(level=logging.INFO, format=FORMAT)
    for name in settings.debug_loggers:
        logging.getLogger(name).setLevel(logging.DEBUG)
