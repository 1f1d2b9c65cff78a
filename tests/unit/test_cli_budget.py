"""``tokenbus budget set``: what it publishes, and the option combinations it refuses."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import tokenbus.budget_admin as budget_admin
from tokenbus.config import Settings
from tokenbus_cli import cli

KEY = "a" * 64


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, object] | None]]:
    records: list[tuple[str, dict[str, object] | None]] = []

    async def publish(settings: Settings, key: bytes, value: bytes | None) -> None:
        records.append((key.decode(), None if value is None else json.loads(value)))

    monkeypatch.setattr(budget_admin, "publish_budget_change", publish)
    monkeypatch.setenv("TOKENBUS_BUDGET_TZ", "UTC")
    return records


def budget_set(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.main, ["budget", "set", *args])
    return result.exit_code, result.output


def test_delete_names_the_budget_set_with_the_same_options_and_needs_no_limit(
    published: list[tuple[str, dict[str, object] | None]],
) -> None:
    assert budget_set("--tenant", "acme", "--limit", "500", "--tz", "Europe/Berlin")[0] == 0
    code, output = budget_set("--tenant", "acme", "--tz", "Europe/Berlin", "--delete")
    assert code == 0, output
    assert published[-1] == ("tenant:acme|month@Europe/Berlin", None)
    assert output.startswith("removed tenant:acme|month@Europe/Berlin: the month budget in")
    assert "Europe/Berlin of tenant:acme" in output
    # without --tz it names the default zone's budget, and says which one it removed
    code, output = budget_set("--tenant", "acme", "--delete")
    assert published[-1] == ("tenant:acme|month@UTC", None)
    assert "the month budget in UTC of tenant:acme" in output
    assert "other periods or zones stay" in output


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--tenant", "acme", "--limit", "0", "--delete"], "--limit"),
        (["--tenant", "acme", "--soft", "--delete"], "--soft"),
        (["--tenant", "acme", "--thresholds", "50", "--delete"], "--thresholds"),
        (["--tenant", "acme", "--key-sha256", KEY, "--limit", "5"], "--key-sha256"),
        (["--model", "tiny", "--key-sha256", KEY, "--limit", "5"], "--key-sha256"),
        (["--tenant", "acme", "--period", "rolling:24h", "--tz", "UTC", "--limit", "5"], "--tz"),
        (["--tenant", "no such tenant|x", "--limit", "5"], "--tenant"),
        (["--tenant", "acme"], "--limit"),
    ],
)
def test_a_meaningless_combination_is_refused_naming_the_option(
    args: list[str], named: str, published: list[tuple[str, dict[str, object] | None]]
) -> None:
    code, output = budget_set(*args)
    assert code == 2, output
    assert named in output
    assert published == []


def test_set_publishes_the_budget(published: list[tuple[str, dict[str, object] | None]]) -> None:
    code, output = budget_set("--key-sha256", KEY, "--limit", "5", "--period", "rolling:24h")
    assert (code, output) == (0, f"set key:{KEY}|rolling:24h\n")
    [(key, value)] = published
    assert key == f"key:{KEY}|rolling:24h"
    assert value is not None
    assert (value["limit"], value["thresholds"], value["tenant"]) == ("5", [50, 80, 95, 100], None)
