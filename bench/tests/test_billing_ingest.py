from __future__ import annotations

from rich.console import Console

from bench.billing_ingest import render


def _row(**extra: float) -> dict[str, float]:
    return {
        "num_tenants": 10,
        "batch_rows": 50_000,
        "num_handled": 200_000,
        "events_per_s": 90_000.0,
        "events_per_core_s": 125_000.0,
        **extra,
    }


def test_the_table_shows_cpu_kernel_and_faults_per_event() -> None:
    console = Console(record=True, width=200)
    render(
        [
            _row(
                heap_reserve_mb=128,
                us_cpu_per_event=8.0,
                us_system_per_event=1.25,
                minor_faults_per_event=0.118,
            )
        ],
        console,
        "t",
    )
    text = console.export_text()
    assert "125000" in text and "8.00" in text and "1.25" in text and "0.118" in text
    assert "128" in text and "NOT met" in text


def test_a_result_written_before_those_figures_shows_dashes() -> None:
    console = Console(record=True, width=200)
    render([_row()], console, "t")
    row = next(line for line in console.export_text().splitlines() if "125000" in line)
    assert row.count("-") == 4
