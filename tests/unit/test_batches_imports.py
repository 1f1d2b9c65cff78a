"""Each entry point imports on its own (no import cycle between batches/ and bridge/)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module", ["batches.__main__", "bridge.batch_lines", "tokenbus_cli.batch", "bridge"]
)
def test_the_module_imports_first(module: str) -> None:
    code = f"import {module}; import bridge.batch_lines, batches.run, tokenbus.batch.submit"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
