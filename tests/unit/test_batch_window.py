"""The completion window a batch is submitted with: OpenAI's ``24h``, or seconds, minutes, days."""

from __future__ import annotations

import pytest

from tokenbus.batch.submit import parse_window


@pytest.mark.parametrize(
    ("text", "seconds"), [("24h", 86400), ("90s", 90), ("30m", 1800), ("2d", 172800)]
)
def test_windows_parse(text: str, seconds: float) -> None:
    assert parse_window(text, min_s=10, max_s=7 * 86400) == seconds


@pytest.mark.parametrize(
    "text", ["", "24", "h", "-1h", "1.5h", "0s", "24 h", "24H", "1w", "01h", "24h\n"]
)
def test_a_malformed_window_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="completion_window"):
        parse_window(text, min_s=1, max_s=1e9)


def test_a_window_out_of_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="between"):
        parse_window("5s", min_s=10, max_s=100)
    with pytest.raises(ValueError, match="between"):
        parse_window("1h", min_s=10, max_s=100)
