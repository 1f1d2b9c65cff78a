"""The TOML price table: the bundled one loads, and mistakes name their entry."""

from decimal import Decimal
from pathlib import Path

import pytest

from schemas import UsageStatus
from tokenbus.config import Settings
from tokenbus.price_file import (
    BUNDLED_PRICES,
    PriceFileError,
    load_price_book,
    read_price_book,
)

ENTRY = """
[[price]]
model = "m"
version = 1
effective_from = 2026-01-01T00:00:00Z
input_per_1k = "0.0005"
output_per_1k = 0.0015
cached_input_per_1k = 0
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prices.toml"
    path.write_text(text)
    return path


def test_the_bundled_table_prices_every_model() -> None:
    book = read_price_book(BUNDLED_PRICES)

    assert {p.model for p in book.prices} >= {"*", "tiny-llama"}
    assert book.policy.share(UsageStatus.OK) == 1
    assert book.policy.share(UsageStatus.FAILED) == 0


def test_settings_choose_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, ENTRY)

    book = load_price_book(Settings(home=tmp_path, billing_prices_file=path))

    [price] = book.prices
    assert price.model == "m"
    assert price.input_per_1k == Decimal("0.0005")
    assert price.output_per_1k == Decimal("0.0015")  # a TOML float, kept exact
    assert price.effective_from.tzinfo is not None
    assert book.policy.share(UsageStatus.CANCELLED) == 1  # defaults without [charge]


def test_the_charge_section_overrides_shares(tmp_path: Path) -> None:
    path = _write(tmp_path, "[charge]\nfailed = 0.25\n" + ENTRY)

    book = read_price_book(path)

    assert book.policy.share(UsageStatus.FAILED) == Decimal("0.25")
    assert book.policy.share(UsageStatus.OK) == 1


def test_a_local_start_without_offset_is_utc(tmp_path: Path) -> None:
    path = _write(tmp_path, ENTRY.replace("2026-01-01T00:00:00Z", "2026-01-01T00:00:00"))

    [price] = read_price_book(path).prices

    assert price.effective_from.utcoffset() is not None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no \\[\\[price\\]\\] entries"),
        ("[prices]\n", "unknown sections"),
        (ENTRY.replace('model = "m"\n', ""), "missing fields \\['model'\\]"),
        (ENTRY + "colour = 1\n", "unknown fields \\['colour'\\]"),
        (ENTRY.replace("version = 1", "version = 0"), "version must be an integer >= 1"),
        (ENTRY.replace('"0.0005"', '"-1"'), "input_per_1k must be a finite number >= 0"),
        (ENTRY.replace('"0.0005"', '"cheap"'), "not a decimal number"),
        (ENTRY.replace('"0.0005"', "true"), "input_per_1k must be a number"),
        (ENTRY.replace("2026-01-01T00:00:00Z", '"soon"'), "effective_from must be"),
        ("[charge]\nlost = 1\n" + ENTRY, "unknown statuses \\['lost'\\]"),
        ("[charge]\nfailed = 2\n" + ENTRY, "between 0 and 1"),
        (ENTRY + ENTRY, "twice"),
        ("[[price]\n", "cannot read prices"),
    ],
)
def test_mistakes_are_reported_with_their_place(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)

    with pytest.raises(PriceFileError, match=message):
        read_price_book(path)


def test_a_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(PriceFileError, match="cannot read prices"):
        read_price_book(tmp_path / "absent.toml")


def test_batch_lines_cost_half_by_default_and_the_batch_section_says_otherwise(
    tmp_path: Path,
) -> None:
    assert read_price_book(BUNDLED_PRICES).batch_multiplier == Decimal("0.5")
    assert read_price_book(_write(tmp_path, ENTRY)).batch_multiplier == Decimal("0.5")

    book = read_price_book(_write(tmp_path, "[batch]\nmultiplier = 0.6\n" + ENTRY))

    assert book.batch_multiplier == Decimal("0.6")  # a TOML float, kept exact


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[batch]\nmultiplier = 1.5\n", "\\[batch\\] multiplier: a share of the list price"),
        ("[batch]\nmultiplier = -0.5\n", "\\[batch\\] multiplier must be a finite number >= 0"),
        ("[batch]\nmultiplier = 0.1234567\n", "more than 6 decimals"),
        ("[batch]\ndiscount = 0.5\n", "\\[batch\\]: unknown fields \\['discount'\\]"),
    ],
)
def test_a_bad_batch_multiplier_is_reported(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(PriceFileError, match=message):
        read_price_book(_write(tmp_path, text + ENTRY))
