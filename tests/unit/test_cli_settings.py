"""A bad setting ends a ``tokenbus`` command with a line naming it, not a traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tokenbus_cli import cli


@pytest.mark.parametrize("command", [["ask", "hi", "--tenant", "demo"], ["status"]])
def test_a_bad_setting_is_named_and_its_value_not_echoed(
    command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENBUS_REPLY_TOPIC_FORGET_S", "-12345")
    monkeypatch.setenv("TOKENBUS_REPLY_TOPIC_ROLL_RECORDS", "lots")
    result = CliRunner().invoke(cli.main, command)
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "invalid settings:" in result.output
    assert "TOKENBUS_REPLY_TOPIC_FORGET_S: Input should be greater than 0" in result.output
    assert "TOKENBUS_REPLY_TOPIC_ROLL_RECORDS: Input should be a valid integer" in result.output
    assert "-12345" not in result.output  # a value may be a secret


def test_another_model_s_validation_error_is_not_taken_for_a_setting() -> None:
    from pydantic import BaseModel, ValidationError

    class Line(BaseModel):
        n: int

    @cli.main.command("bad-line")
    def bad_line() -> None:
        Line(n="x")  # type: ignore[arg-type]

    try:
        result = CliRunner().invoke(cli.main, ["bad-line"])
    finally:
        cli.main.commands.pop("bad-line")
    assert isinstance(result.exception, ValidationError)
    assert "invalid settings" not in result.output


@pytest.mark.parametrize("value", [59.0, float("nan"), float("inf"), -1.0])
def test_request_dedupe_outlasts_the_quota_window(value: float) -> None:
    # The ledger entry of a request keeps its quota reservation: it must live the minute.
    from pydantic import ValidationError

    from tokenbus.config import Settings

    with pytest.raises(ValidationError, match="request_dedupe_s"):
        Settings(request_dedupe_s=value)
    assert Settings(request_dedupe_s=60.0).request_dedupe_s == 60.0
