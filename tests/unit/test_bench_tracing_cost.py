"""bench.tracing_cost's pairing: each round's traced wave against its untraced one."""

from __future__ import annotations

from bench.driver import RequestTrace, WaveResult
from bench.tracing_cost import paired


def wave(num_tokens: int) -> WaveResult:
    trace = RequestTrace(index=0, started=0.0, arrivals=[(0.1, num_tokens)])
    return WaveResult(concurrency=64, wall_s=1.0, traces=[trace])


def cpu_s(job: float) -> dict[str, float]:
    return {"stream_job": job, "worker_process": 0.0, "billing": 0.0, "client": 0.0, "broker": 1.0}


def test_the_cost_is_the_median_of_each_rounds_pair_with_its_spread() -> None:
    # Three rounds on a drifting machine: the untraced waves cost 100, 200, 150 µs a
    # token, and each traced wave 2%, 4%, 3% more than its own round's.
    untraced = [100e-6, 200e-6, 150e-6]
    traced = [102e-6, 208e-6, 154.5e-6]
    cpu = {
        ("traced", 64): [cpu_s(t * 1000) for t in traced],
        ("untraced", 64): [cpu_s(u * 1000) for u in untraced],
    }
    waves = {(arm, 64): [wave(1000)] * 3 for arm in ("traced", "untraced")}
    result = paired(cpu, waves, 64)
    assert result["num_rounds"] == 3
    assert result["tokenbus_added_pct"] == {"median": 3.0, "min": 2.0, "max": 4.0}
    assert result["stream_job_added_pct"] == result["tokenbus_added_pct"]
    assert result["broker_added_pct"] == {"median": 0.0, "min": 0.0, "max": 0.0}
    assert result["untraced_tokenbus_us_per_token"] == {"median": 150.0, "min": 100.0, "max": 200.0}
    assert result["worker_process_added_pct"] == {}  # nothing to compare: no CPU at all
