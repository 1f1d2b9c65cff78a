from __future__ import annotations

from pathlib import Path

import pytest

from bench import markdown


def test_update_rewrites_only_the_marked_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(markdown, "render", lambda name, kind=None: f"table of {name} ({kind})")
    doc = tmp_path / "B.md"
    doc.write_text(
        "intro\n<!-- bench:relay -->\nold\n<!-- /bench:relay -->\nmiddle\n"
        "<!-- bench:overhead-x kind=overhead -->\n<!-- /bench:overhead-x -->\nend\n"
    )
    assert markdown.update(doc) == 2
    assert doc.read_text() == (
        "intro\n<!-- bench:relay -->\ntable of relay (None)\n<!-- /bench:relay -->\nmiddle\n"
        "<!-- bench:overhead-x kind=overhead -->\ntable of overhead-x (overhead)\n"
        "<!-- /bench:overhead-x -->\nend\n"
    )
