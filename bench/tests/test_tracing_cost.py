"""bench.tracing_cost's pure parts: the parent a wave's requests carry, and the figures."""

from __future__ import annotations

from opentelemetry.trace import get_current_span

from bench.driver import RequestTrace, WaveResult
from bench.tracing_cost import arm_summary, compare, parent_context
from tokenbus.tracing import inject


def test_the_parent_says_sampled_or_not_in_the_traceparent() -> None:
    for sampled, flags in ((True, "01"), (False, "00")):
        context = parent_context(sampled)
        assert get_current_span(context).get_span_context().is_valid
        headers: list[tuple[str, bytes]] = []
        inject(headers, context)
        ((name, value),) = headers
        assert name == "traceparent" and value.decode().endswith(f"-{flags}")


def wave(num_requests: int, tokens: int) -> WaveResult:
    traces = []
    for index in range(num_requests):
        trace = RequestTrace(index=index, started=0.0)
        trace.arrivals = [(0.010 + index * 0.001, tokens)]
        trace.ended = 0.1
        traces.append(trace)
    return WaveResult(4, 1.0, traces)


def test_cpu_per_token_and_the_cost_of_tracing() -> None:
    cpu = {"stream_job": 0.5, "worker_process": 0.3, "billing": 0.1, "client": 0.1, "broker": 1.0}
    off = arm_summary([wave(10, 100)], [cpu])
    on = arm_summary([wave(10, 100)], [{**cpu, "stream_job": 0.53}])
    assert off["num_tokens"] == 1000
    assert off["us_cpu_per_token"]["tokenbus"] == 1000.0  # 1.0 s over 1,000 tokens
    assert off["us_cpu_per_token"]["broker"] == 1000.0
    cost = compare(on, off)
    assert cost["cpu_per_token_added_pct"] == 3.0
    assert cost["ttft_p50_ratio"] == 1.0
