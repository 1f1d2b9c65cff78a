"""Workarounds for the bundled development broker, tansu 0.6.0: the ``tansu`` profile.

``Settings.broker_profile`` is the one switch. ``tokenbus up`` sets ``tansu`` when it
runs the bundled broker; everywhere else the default is ``kafka``, where none of this is
installed and producers are idempotent with ``acks=all``. Each workaround patches a
private method of aiokafka or Faust for the whole process (``patch.Patch``: the shipped
method kept, put back by ``uninstall``), so each is installed here and nowhere else:

- ``gaps``: a consumer refetches across an offset gap before it accepts it (tansu can
  show a later batch before an earlier one);
- ``fetch_wait``: a consumer whose fetches keep coming back empty behind the high-water
  mark lengthens its fetch wait (a tansu fetch costs more as a partition grows), and one
  that expects a record soon shortens it (tansu answers a parked fetch late);
- ``faust_fetch``: the Faust job's fetch wait is bounded (tansu answers a parked fetch
  later the longer its wait).

The figures behind each are in BENCHMARKS.md and the modules' docstrings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenbus.tansu import fetch_wait, gaps

if TYPE_CHECKING:
    from tokenbus.config import Settings


def install_for_consumers(settings: Settings) -> None:
    """Before an aiokafka consumer is made: the consumer workarounds, on tansu only."""
    if settings.broker_profile != "tansu":
        return
    gaps.refetch_across_gaps(f"{settings.topic_prefix}.", settings.kafka_gap_settle_s)
    fetch_wait.adapt_fetch_waits(
        settings.fetch_max_wait_cap_ms,
        settings.eager_fetch_wait_ms,
        settings.eager_fetch_window_ms,
    )


def install_for_faust(settings: Settings) -> None:
    """Before the Faust app is made: the consumer workarounds and Faust's fetch wait, on
    tansu only. Imports Faust, so only the stream environment calls it."""
    if settings.broker_profile != "tansu":
        return
    from tokenbus.tansu.faust_fetch import bound_faust_fetch_wait

    install_for_consumers(settings)
    bound_faust_fetch_wait(settings.job_fetch_max_wait_ms)


def uninstall() -> None:
    """Every workaround off: aiokafka and Faust as they ship (benchmarks, tests)."""
    import sys

    gaps.uninstall()
    fetch_wait.uninstall()
    if "faust" in sys.modules:
        from tokenbus.tansu import faust_fetch

        faust_fetch.uninstall()
