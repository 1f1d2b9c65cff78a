from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenbus.config import Settings


def test_the_stream_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENBUS_STREAM_INTERVAL", raising=False)
    assert Settings().stream_interval == 1  # each token as it is made, as vLLM's default
    monkeypatch.setenv("TOKENBUS_STREAM_INTERVAL", "8")
    assert Settings().stream_interval == 8


@pytest.mark.parametrize("value", ["0", "-3", "1025", "eight"])
def test_a_stream_interval_out_of_range_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("TOKENBUS_STREAM_INTERVAL", value)
    with pytest.raises(ValidationError, match="stream_interval"):
        Settings()
