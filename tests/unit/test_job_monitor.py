"""The job starts without Faust's Monitor sensor: nothing is fed per message."""

from __future__ import annotations

from pathlib import Path

import faust

from stream_jobs.app import drop_faust_monitor


def unstarted_app(datadir: Path) -> faust.App:
    return faust.App("monitor-test", broker="kafka://127.0.0.1:9", datadir=str(datadir))


def test_the_monitor_is_not_among_the_sensors_once_the_app_starts(tmp_path: Path) -> None:
    app = unstarted_app(tmp_path)
    drop_faust_monitor(app)
    list(app.on_init_dependencies())  # what starting the app runs first
    assert app.monitor not in set(app.sensors)
    # A rebalance still finds a sensor's state (Faust warns when it finds none).
    assert app.sensors.on_rebalance_start(app)
    # The sensors' hooks still run, for whatever other sensor there is.
    app.sensors.on_table_set(None, b"k", b"v")  # type: ignore[arg-type]


def test_without_it_faust_adds_the_monitor(tmp_path: Path) -> None:
    app = unstarted_app(tmp_path)
    list(app.on_init_dependencies())
    assert app.monitor in set(app.sensors)
