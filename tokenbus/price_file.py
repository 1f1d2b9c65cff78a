"""The TOML price table --> a PriceBook, validated at start with errors that say where.

Format: see the bundled ``tokenbus/prices.toml``. Amounts may be TOML strings or numbers;
both go through ``str`` into ``Decimal``, so ``0.0005`` stays exactly 0.0005.
"""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from schemas import UsageStatus
from tokenbus.config import Settings
from tokenbus.pricing import (
    DEFAULT_BATCH_MULTIPLIER,
    DEFAULT_SHARES,
    ChargePolicy,
    Price,
    PriceBook,
)

BUNDLED_PRICES = Path(__file__).with_name("prices.toml")
_AMOUNTS = ("input_per_1k", "output_per_1k", "cached_input_per_1k")


class PriceFileError(ValueError):
    """The price file is missing, unreadable or invalid; the message names the entry."""


def load_price_book(settings: Settings) -> PriceBook:
    return read_price_book(settings.billing_prices_file or BUNDLED_PRICES)


def read_price_book(path: Path) -> PriceBook:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PriceFileError(f"cannot read prices from {path}: {exc}") from None
    try:
        return parse_price_book(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise PriceFileError(f"{path}: {exc}") from None


def parse_price_book(data: dict[str, Any]) -> PriceBook:
    unknown = set(data) - {"charge", "price", "batch"}
    if unknown:
        raise ValueError(
            f"unknown sections {sorted(unknown)}; expected [charge], [batch] and [[price]]"
        )
    entries = data.get("price", [])
    if not isinstance(entries, list) or not entries:
        raise ValueError("no [[price]] entries")
    prices = [_price(entry, n) for n, entry in enumerate(entries, start=1)]
    return PriceBook(prices, _policy(data.get("charge", {})), _batch(data.get("batch", {})))


def _price(entry: Any, n: int) -> Price:
    where = f"[[price]] #{n}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not a table")
    expected = {"model", "version", "effective_from", *_AMOUNTS}
    missing, unknown = sorted(expected - set(entry)), sorted(set(entry) - expected)
    if missing or unknown:
        raise ValueError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    model, version, start = entry["model"], entry["version"], entry["effective_from"]
    where = f"{where} (model {model!r} version {version!r})"
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where}: model must be a non-empty string")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{where}: version must be an integer >= 1")
    if not isinstance(start, datetime):
        raise ValueError(f"{where}: effective_from must be a TOML date-time")
    amounts = {name: _amount(entry[name], f"{where}: {name}") for name in _AMOUNTS}
    return Price(
        model=model,
        version=version,
        effective_from=start.replace(tzinfo=UTC) if start.tzinfo is None else start,
        **amounts,
    )


def _policy(table: Any) -> ChargePolicy:
    if not isinstance(table, dict):
        raise ValueError("[charge] is not a table")
    known = {status.value: status for status in UsageStatus}
    unknown = set(table) - set(known)
    if unknown:
        raise ValueError(f"[charge]: unknown statuses {sorted(unknown)}; known {sorted(known)}")
    shares = dict(DEFAULT_SHARES)
    shares.update(
        {known[name]: _amount(value, f"[charge] {name}") for name, value in table.items()}
    )
    for status, share in shares.items():
        if share > 1:
            raise ValueError(f"[charge] {status.value}: a share is between 0 and 1, got {share}")
    return ChargePolicy(shares)


def _batch(table: Any) -> Decimal:
    """``[batch] multiplier``: the share of the list price a batch line costs."""
    if not isinstance(table, dict):
        raise ValueError("[batch] is not a table")
    unknown = set(table) - {"multiplier"}
    if unknown:
        raise ValueError(f"[batch]: unknown fields {sorted(unknown)}; expected multiplier")
    if "multiplier" not in table:
        return DEFAULT_BATCH_MULTIPLIER
    multiplier = _amount(table["multiplier"], "[batch] multiplier")
    if multiplier > 1:
        raise ValueError(f"[batch] multiplier: a share of the list price, 0 to 1, got {multiplier}")
    return multiplier


def _amount(value: Any, where: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{where} must be a number or a decimal string")
    try:
        amount = Decimal(str(value))
    except InvalidOperation:
        raise ValueError(f"{where}: {value!r} is not a decimal number") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"{where} must be a finite number >= 0, got {value!r}")
    return amount
