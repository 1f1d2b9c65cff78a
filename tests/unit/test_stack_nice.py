"""A niced service's whole session yields the CPU, not just its own process."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tokenbus_cli.stack import renice_session

AUTOGROUPS = Path("/proc/sys/kernel/sched_autogroup_enabled")


@pytest.mark.skipif(
    not AUTOGROUPS.exists() or AUTOGROUPS.read_text().strip() != "1",
    reason="this kernel does not schedule by autogroup: a process's own niceness is all",
)
def test_the_session_of_a_niced_service_is_niced() -> None:
    ours = Path("/proc/self/autogroup").read_text()
    process = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        before = Path(f"/proc/{process.pid}/autogroup").read_text()
        renice_session(process.pid, 10)
        after = Path(f"/proc/{process.pid}/autogroup").read_text()
    finally:
        process.kill()
        process.wait()
    assert before.split()[-1] == "0", before
    assert after.split()[-1] == "10", after
    # Its own session, not the test's: the test's is untouched.
    assert Path("/proc/self/autogroup").read_text() == ours


def test_a_gone_process_is_no_error() -> None:
    process = subprocess.Popen(["true"], start_new_session=True)
    process.wait()
    renice_session(process.pid, 10)  # no such /proc entry any more: nothing to do
    assert not Path(f"/proc/{process.pid}/autogroup").exists()
