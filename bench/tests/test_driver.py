from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from bench.driver import RequestTrace, WaveResult, run_wave


async def test_a_wave_sends_every_prompt_once_and_keeps_concurrency() -> None:
    running = 0
    peak = 0

    async def stream(index: int, text: str) -> AsyncIterator[int]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        for n in (1, 2, 0, 1):
            await asyncio.sleep(0.001)
            yield n
        running -= 1

    result = await run_wave(stream, [f"p{i}" for i in range(10)], concurrency=3)
    assert [t.index for t in result.traces] == list(range(10))
    assert peak == 3
    summary = result.summary()
    assert summary["num_tokens"] == 40  # deltas with 0 tokens are not arrivals
    assert summary["ttft_ms"]["n"] == 10
    assert summary["itl_ms"]["n"] == 10 * 3  # deltas of 1, 2, 1 tokens: one gap per later token


async def test_a_failed_request_is_recorded_not_raised() -> None:
    async def stream(index: int, text: str) -> AsyncIterator[int]:
        yield 1
        if index == 1:
            raise RuntimeError("boom")

    result = await run_wave(stream, ["a", "b"], concurrency=2)
    assert result.summary()["num_errors"] == 1
    assert result.traces[1].error == "RuntimeError: boom"


def test_gaps_count_each_token_of_a_multi_token_delta() -> None:
    trace = RequestTrace(index=0, started=0.0, arrivals=[(1.0, 1), (1.5, 2), (2.0, 1)])
    assert trace.ttft_s == 1.0
    assert trace.gaps_s() == [0.25, 0.25, 0.5]


def test_waves_round_trip_through_json() -> None:
    trace = RequestTrace(index=3, started=1.0, arrivals=[(1.2, 1)], ended=1.3)
    wave = WaveResult(concurrency=1, wall_s=0.3, traces=[trace])
    assert WaveResult.from_json(wave.to_json()) == wave
