"""Billing's /metrics (billing.metrics): the sink's counts, billing lag, usage lag."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from billing.metrics import billing_registry
from tokenbus.metrics import PartitionOffsets


class Sink:
    def __init__(self) -> None:
        self.newest_created_at: float | None = None
        self.num_inserted = 0

    def stats(self) -> dict[str, int]:
        return {"num_inserted": self.num_inserted, "num_dead_letters": 2, "num_batches": 1}


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_rows_dead_letters_billing_lag_and_usage_lag() -> None:
    sink = Sink()
    registry = billing_registry(
        sink,
        lambda: [PartitionOffsets("tokenbus.usage", 0, 12, 9)],
        lambda: {"num_alerts_stored": 4},
    )
    got = _samples(generate_latest(registry))
    assert got[("tokenbus_billing_rows_inserted_total", ())] == 0
    assert ("tokenbus_billing_lag_seconds", ()) not in got  # nothing stored yet

    sink.num_inserted = 5
    sink.newest_created_at = 1.0  # long ago: the lag is now minus that
    got = _samples(generate_latest(registry))
    assert got[("tokenbus_billing_rows_inserted_total", ())] == 5
    assert got[("tokenbus_billing_dead_letters_total", ())] == 2
    assert got[("tokenbus_billing_alerts_stored_total", ())] == 4
    assert got[("tokenbus_billing_lag_seconds", ())] > 1_000_000
    lag = (("consumer", "billing_usage"), ("partition", "0"), ("topic", "tokenbus.usage"))
    assert got[("tokenbus_consumer_lag_records", lag)] == 3
