"""What one request attempt costs: list price x cost weight, and the share billed by status.

Pure: no I/O. ``tokenbus.price_file`` reads the prices. Billing's sink prices each event
once, as it writes the row, and stores the result with the price version it used; the
job's spend budgets price a request's reservation and its settlement with the same
``Pricer``, so both agree to the last nano-unit. An attempt is read through
``PricedUsage``, the fields pricing needs: ``schemas.UsageEvent`` and billing's fast
reading of it both have them.

- ``cost_units``: what the attempt consumed, at list price, times the weight from
  ``tokenbus.cost`` (context length, precision, peak hour), whatever its end. Failed and
  cancelled work is priced too: that is what makes its share of the resources visible.
  Rejected work never ran and costs nothing.
- ``billed_units``: ``cost_units`` times the share the charge policy bills for the status
  (by default all of ok and cancelled work, none of failed or rejected work).
- A line of a batch job (``batch_id`` set) is priced at ``PriceBook.batch_multiplier`` of
  the list price (0.5 by default, as OpenAI discounts batch work): both its
  ``cost_units`` and so its ``billed_units``. The job admits a batch id at class 2 only.

Money is ``Decimal`` quantized to ``COST_QUANTUM``, the scale of the ClickHouse column,
so a sum in ClickHouse equals the sum of the values computed here, to the last digit.
``charge`` computes it in integer nano-units, rounding half to even once, which gives
exactly ``quantize(list_cost(event, price) * weight)`` (tests hold the two together) at a
fraction of the cost of Decimal arithmetic: the sink prices every event it ingests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import NamedTuple, Protocol

from schemas import UsageStatus
from tokenbus.cost import CONTEXT_STEP_TOKENS, NO_PEAK_HOURS, PeakHours, cost_weight


class PricedUsage(Protocol):
    """What one attempt used, as pricing reads it (read-only)."""

    @property
    def model(self) -> str: ...
    @property
    def adapter(self) -> str | None: ...
    @property
    def status(self) -> UsageStatus: ...
    @property
    def created_at(self) -> datetime:
        """The instant its price and peak hours are read at (aware)."""
        ...

    @property
    def precision(self) -> str: ...
    @property
    def batch_id(self) -> str | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_completion_tokens(self) -> int: ...


COST_QUANTUM = Decimal("0.000000001")
"""Nine decimals: ``Decimal(38, 9)`` in ``usage_events``."""
DEFAULT_BATCH_MULTIPLIER = Decimal("0.5")
"""Batch lines at half the list price, unless the price file's ``[batch]`` says otherwise."""
ANY_MODEL = "*"
"""The price entry for every model that has none of its own."""


def priced_name(model: str, adapter: str | None) -> str:
    """The price entry an attempt looks up first: ``base:adapter`` (the name clients use)
    for an adapter's work, which falls back to the base model's entry, then ``*``."""
    return f"{model}:{adapter}" if adapter else model


UNPRICED_VERSION = 0
"""The price version of a row no price applied to; its cost is zero."""
_ZERO = Decimal(0)
_PER = Decimal(1000)
_NANOS = 10**9
"""Nano-units per unit: prices and costs carry nine decimals."""
_MICROS = 10**6
"""Weights and shares carry six decimals at most."""
_PER_WEIGHTED = 1000 * _MICROS
"""A weighted cost at list price (nano-units x 1,000, times a weight in millionths) -->
nano-units."""
_PER_WEIGHTED_BATCH = 1000 * _MICROS * _MICROS
"""The same, times the batch multiplier in millionths."""
_MAX_WEIGHTS = 1024
_MAX_CANDIDATES = 1024
Nanos = tuple[int, int, int]
"""A price's input, output and cached-input amounts per 1k tokens, in nano-units x 1,000."""


@dataclass(frozen=True)
class Price:
    """One version of one model's prices, in cost units per 1,000 tokens."""

    model: str
    version: int
    effective_from: datetime
    """This version applies to requests created at or after this instant (aware)."""
    input_per_1k: Decimal
    output_per_1k: Decimal
    cached_input_per_1k: Decimal
    """Prompt tokens served from the prefix cache."""

    def __post_init__(self) -> None:
        for name in ("input_per_1k", "output_per_1k", "cached_input_per_1k"):
            _scaled(getattr(self, name), _NANOS, f"{self.model} v{self.version} {name}")

    @property
    def nanos_per_1k(self) -> tuple[int, int, int]:
        """(input, output, cached input), in nano-units per 1,000 tokens."""
        return (
            _scaled(self.input_per_1k, _NANOS, "input_per_1k"),
            _scaled(self.output_per_1k, _NANOS, "output_per_1k"),
            _scaled(self.cached_input_per_1k, _NANOS, "cached_input_per_1k"),
        )


DEFAULT_SHARES: Mapping[UsageStatus, Decimal] = {
    UsageStatus.OK: Decimal(1),
    UsageStatus.CANCELLED: Decimal(1),
    UsageStatus.FAILED: Decimal(0),
    UsageStatus.REJECTED: Decimal(0),
}


@dataclass(frozen=True)
class ChargePolicy:
    """The share of an attempt's cost the tenant is billed, by status (0 to 1)."""

    shares: Mapping[UsageStatus, Decimal] = field(default_factory=lambda: dict(DEFAULT_SHARES))

    def __post_init__(self) -> None:
        for status, share in self.shares.items():
            _scaled(share, _MICROS, f"the share billed for {status.value}")

    def share(self, status: UsageStatus) -> Decimal:
        return self.shares.get(status, Decimal(1))


class Charge(NamedTuple):
    # A named tuple, not a frozen dataclass: the sink builds one per event it ingests.
    cost_weight: float
    cost_units: Decimal
    billed_units: Decimal
    price_version: int


class PriceBook:
    """Every price version; ``price_for`` picks the one in force for a model at an instant."""

    def __init__(
        self,
        prices: Sequence[Price],
        policy: ChargePolicy | None = None,
        batch_multiplier: Decimal = DEFAULT_BATCH_MULTIPLIER,
    ) -> None:
        self.prices = tuple(sorted(prices, key=lambda p: (p.model, p.version)))
        self.policy = policy or ChargePolicy()
        self.batch_multiplier = batch_multiplier
        """The share of the list price a batch line costs (0 to 1, six decimals at most)."""
        if not 0 <= batch_multiplier <= 1:
            raise ValueError(f"the batch multiplier is between 0 and 1, got {batch_multiplier}")
        self._batch_micros = _scaled(batch_multiplier, _MICROS, "the batch multiplier")
        self._by_model: dict[str, list[Price]] = {}
        for price in self.prices:
            self._by_model.setdefault(price.model, []).append(price)
        for model, versions in self._by_model.items():
            _check_versions(model, versions)
        # Newest first, with amounts in integers, for the sink's per-event lookup.
        self._newest_first = {
            model: [(p, p.nanos_per_1k) for p in reversed(versions)]
            for model, versions in self._by_model.items()
        }
        self._share_micros = {
            status: _scaled(self.policy.share(status), _MICROS, status.value)
            for status in UsageStatus
        }
        self._candidates: dict[tuple[str, str | None], list[tuple[datetime, Price, Nanos]]] = {}
        """(model, adapter) --> the versions ``_in_force`` tries, in order: a few entries."""

    def price_for(self, model: str, at: datetime, adapter: str | None = None) -> Price | None:
        """The latest version in force at ``at`` of the adapter's entry (``base:adapter``),
        else the model's, else that of ``ANY_MODEL``."""
        found = self._in_force(model, at, adapter)
        return found[0] if found else None

    def _in_force(
        self, model: str, at: datetime, adapter: str | None = None
    ) -> tuple[Price, Nanos] | None:
        candidates = self._candidates.get((model, adapter))
        if candidates is None:
            if len(self._candidates) >= _MAX_CANDIDATES:
                self._candidates.clear()  # odd model names must not grow it forever
            names = (
                (priced_name(model, adapter), model, ANY_MODEL) if adapter else (model, ANY_MODEL)
            )
            candidates = self._candidates[(model, adapter)] = [
                (price.effective_from, price, nanos)
                for name in names
                for price, nanos in self._newest_first.get(name, ())
            ]
        for effective_from, price, nanos in candidates:
            if effective_from <= at:
                return price, nanos
        return None


class Pricer:
    """UsageEvent --> Charge, with one price book and one set of peak hours."""

    def __init__(self, book: PriceBook, peak_hours: PeakHours = NO_PEAK_HOURS) -> None:
        self.book = book
        self.peak_hours = peak_hours
        self._weights: dict[tuple[int, str, bool], tuple[float, int]] = {}
        """(context steps, precision, peak) --> the cost weight, and it in millionths: a
        few dozen entries at most."""

    def _weight(self, event: PricedUsage, key: tuple[int, str, bool]) -> tuple[float, int]:
        """The weight of ``event``, whose key in ``_weights`` is ``key``: kept there."""
        if len(self._weights) >= _MAX_WEIGHTS:
            self._weights.clear()  # odd precision strings must not grow it forever
        weight = cost_weight(
            event.num_prompt_tokens, event.precision, event.created_at, self.peak_hours
        )
        found = self._weights[key] = (weight, round(weight * _MICROS))
        return found

    def charge(self, event: PricedUsage) -> Charge:
        weight, cost_nanos, billed_nanos, version = self.charge_nanos(event)
        if version == UNPRICED_VERSION or event.status is UsageStatus.REJECTED:
            return _new_charge(Charge, (weight, _ZERO, _ZERO, version))
        cost = Decimal(cost_nanos).scaleb(-9)
        if self.book._share_micros[event.status] == _MICROS:
            return _new_charge(Charge, (weight, cost, cost, version))
        return _new_charge(Charge, (weight, cost, Decimal(billed_nanos).scaleb(-9), version))

    def charge_nanos(self, event: PricedUsage) -> NanoCharge:
        """``charge``, its costs in integer nano-units: what the sink writes."""
        return self.charge_nanos_each((event,))[0]

    def charge_nanos_each(self, events: Iterable[PricedUsage]) -> list[NanoCharge]:
        """``charge_nanos`` of each event, in order, in one loop: the sink prices every
        event it ingests, and a call per event (with the lookups and the rounding as
        calls of their own) was most of the cost of pricing one."""
        book = self.book
        in_force = book._in_force
        share_micros = book._share_micros
        batch_micros = book._batch_micros
        weights = self._weights
        peak_hours = self.peak_hours
        has_peak_hours = bool(peak_hours.hours)
        rejected = UsageStatus.REJECTED
        charges: list[NanoCharge] = []
        append = charges.append
        for event in events:
            created_at = event.created_at
            num_prompt = event.num_prompt_tokens
            # The weight's key, read here rather than in ``_weight``: no call per event.
            key = (
                (num_prompt if num_prompt > 0 else 0) // CONTEXT_STEP_TOKENS,
                event.precision,
                has_peak_hours and peak_hours.contains(created_at),
            )
            weight, weight_micros = weights.get(key) or self._weight(event, key)
            found = in_force(event.model, created_at, event.adapter)
            if found is None:
                append((weight, 0, 0, UNPRICED_VERSION))
                continue
            price, (input_nanos, output_nanos, cached_nanos) = found
            status = event.status
            if status is rejected:
                # Refused before it ran: a prompt the dispatcher counted was never computed.
                append((weight, 0, 0, price.version))
                continue
            num_cached = event.num_cached_tokens
            if num_cached < 0:
                num_cached = 0
            if num_cached > num_prompt:
                num_cached = num_prompt
            at_list_price = (
                (num_prompt - num_cached) * input_nanos
                + num_cached * cached_nanos
                + event.num_completion_tokens * output_nanos
            )  # nano-units x 1,000
            # Rounded half to even once (``_divide_half_even``, written out).
            if event.batch_id is None:
                numerator, denominator = at_list_price * weight_micros, _PER_WEIGHTED
            else:  # a batch line: at the batch share of the list price
                numerator = at_list_price * weight_micros * batch_micros
                denominator = _PER_WEIGHTED_BATCH
            cost_nanos, remainder = divmod(numerator, denominator)
            if 2 * remainder > denominator or (2 * remainder == denominator and cost_nanos % 2):
                cost_nanos += 1
            share = share_micros[status]
            if share == _MICROS:  # all of it, as for ok work by default
                append((weight, cost_nanos, cost_nanos, price.version))
            else:
                append(
                    (
                        weight,
                        cost_nanos,
                        _divide_half_even(cost_nanos * share, _MICROS),
                        price.version,
                    )
                )
        return charges


NanoCharge = tuple[float, int, int, int]
"""``Charge`` with its costs in integer nano-units (``COST_QUANTUM``): cost weight, cost,
billed, price version. ``Decimal(n).scaleb(-9)`` is the cost ``charge`` gives."""

_new_charge = tuple.__new__
"""``Charge(...)`` without the Python-level ``__new__`` a named tuple has: once per event."""


def list_cost(event: PricedUsage, price: Price) -> Decimal:
    """Tokens at list price, before the weight: cached prompt tokens at the cached rate.

    The definition, in Decimal; ``Pricer.charge`` computes the same in integers (times
    the batch multiplier for a batch line).
    """
    num_cached = min(max(event.num_cached_tokens, 0), event.num_prompt_tokens)
    num_uncached = event.num_prompt_tokens - num_cached
    return (
        num_uncached * price.input_per_1k
        + num_cached * price.cached_input_per_1k
        + event.num_completion_tokens * price.output_per_1k
    ) / _PER


def quantize(value: Decimal) -> Decimal:
    return value.quantize(COST_QUANTUM, rounding=ROUND_HALF_EVEN)


def _divide_half_even(numerator: int, denominator: int) -> int:
    quotient, remainder = divmod(numerator, denominator)
    if 2 * remainder > denominator or (2 * remainder == denominator and quotient % 2):
        quotient += 1
    return quotient


def _scaled(amount: Decimal, scale: int, what: str) -> int:
    """``amount * scale`` as an integer; a value with more decimals than that is refused."""
    scaled = amount * scale
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{what} has more than {len(str(scale)) - 1} decimals: {amount}")
    return int(scaled)


def _check_versions(model: str, versions: list[Price]) -> None:
    numbers = [p.version for p in versions]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"model {model!r} lists a price version twice: {numbers}")
    if any(p.version <= UNPRICED_VERSION for p in versions):
        raise ValueError(f"model {model!r}: price versions start at 1")
    starts = [p.effective_from for p in versions]
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        raise ValueError(
            f"model {model!r}: a later price version must take effect later than the one before"
        )
