import subprocess
import sys
import time
from pathlib import Path

import pytest
from clickhouse_connect.driver.exceptions import ClickHouseError

from billing.__main__ import _open_writer

_HOLD = """
import sys, time
from billing.storage import ClickHouseStore
store = ClickHouseStore(sys.argv[1])
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
store.close()
"""


def _hold(dsn: str, seconds: float) -> subprocess.Popen[str]:
    """Another process (a CLI report, say) holding the chdb directory for a while."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, dsn, str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "holding"
    return holder


async def test_the_sink_waits_for_a_reader_to_let_go_of_the_directory(tmp_path: Path) -> None:
    dsn = f"chdb://{tmp_path / 'ch'}"
    holder = _hold(dsn, 1.5)
    try:
        started = time.monotonic()
        store = await _open_writer(dsn, timeout_s=20)
        store.close()
        assert time.monotonic() - started > 0.5  # it did have to wait
    finally:
        holder.wait(timeout=20)


async def test_a_directory_held_for_good_is_an_error_after_the_timeout(tmp_path: Path) -> None:
    dsn = f"chdb://{tmp_path / 'ch'}"
    holder = _hold(dsn, 30)
    try:
        with pytest.raises(ClickHouseError, match="chdb engine"):
            await _open_writer(dsn, timeout_s=0.5)
    finally:
        holder.kill()
        holder.wait(timeout=20)
