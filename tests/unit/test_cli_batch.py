"""``tokenbus batch submit``: options it refuses before it reads or writes anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenbus_cli import cli


@pytest.mark.parametrize("pair", ["team:ml", "=ml"])
def test_metadata_that_is_not_key_value_is_refused_not_dropped(
    pair: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENBUS_HOME", str(tmp_path))
    lines = tmp_path / "in.jsonl"
    lines.write_text("")
    args = ["batch", "submit", str(lines), "--tenant", "acme", "--metadata", "owner=ana"]
    result = CliRunner().invoke(cli.main, [*args, "--metadata", pair])
    assert result.exit_code == 2, result.output
    assert "--metadata" in result.output
    assert f"expected key=value, got {pair!r}" in result.output
    assert list(tmp_path.iterdir()) == [lines]  # nothing stored
