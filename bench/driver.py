"""The closed-loop load both overhead arms share: N lanes, each sending back to back.

Stdlib only, so the direct-vLLM arm (worker environment) runs exactly this code too.
A lane records, per request, when it started and when each token-bearing delta arrived.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.stats import summarize

StreamFn = Callable[[int, str], AsyncIterator[int]]
"""(request index, prompt) --> the number of tokens in each delta, as they arrive."""


@dataclass
class RequestTrace:
    index: int
    started: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    """(perf_counter seconds, tokens in that delta) for every delta with tokens."""
    ended: float = 0.0
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0][0] - self.started if self.arrivals else None

    def gaps_s(self) -> list[float]:
        """Time between successive deltas, once per token (a 2-token delta counts twice)."""
        gaps: list[float] = []
        for (prev, _), (now, n) in zip(self.arrivals, self.arrivals[1:], strict=False):
            gaps.extend([(now - prev) / n] * n)
        return gaps


@dataclass
class WaveResult:
    concurrency: int
    wall_s: float
    traces: list[RequestTrace]

    def summary(self) -> dict[str, Any]:
        done = [t for t in self.traces if t.error is None]
        num_tokens = sum(t.num_tokens for t in done)
        return {
            "concurrency": self.concurrency,
            "num_requests": len(self.traces),
            "num_errors": len(self.traces) - len(done),
            "num_tokens": num_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(num_tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "ttft_ms": summarize([t.ttft_s for t in done if t.ttft_s is not None], 1000),
            "itl_ms": summarize([g for t in done for g in t.gaps_s()], 1000),
        }

    def to_json(self) -> dict[str, Any]:
        traces = [asdict(t) for t in self.traces]
        return {"concurrency": self.concurrency, "wall_s": self.wall_s, "traces": traces}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WaveResult:
        traces = [
            RequestTrace(
                index=t["index"],
                started=t["started"],
                arrivals=[(float(a), int(n)) for a, n in t["arrivals"]],
                ended=t["ended"],
                error=t["error"],
            )
            for t in data["traces"]
        ]
        return cls(int(data["concurrency"]), float(data["wall_s"]), traces)


async def run_wave(
    stream: StreamFn,
    prompts: Sequence[str],
    concurrency: int,
    on_done: Callable[[RequestTrace], None] | None = None,
) -> WaveResult:
    """Sends every prompt once, ``concurrency`` at a time, each lane back to back."""
    traces: list[RequestTrace] = []
    next_index = iter(range(len(prompts)))

    async def lane() -> None:
        for index in next_index:  # shared iterator: lanes take the next prompt in turn
            trace = RequestTrace(index=index, started=time.perf_counter())
            traces.append(trace)
            try:
                async for num_tokens in stream(index, prompts[index]):
                    if num_tokens:
                        trace.arrivals.append((time.perf_counter(), num_tokens))
            except Exception as exc:  # one failed request is a figure, not a crash
                trace.error = f"{type(exc).__name__}: {exc}"
            trace.ended = time.perf_counter()
            if on_done is not None:
                on_done(trace)

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return WaveResult(concurrency, time.perf_counter() - started, sorted(traces, key=_index))


def _index(trace: RequestTrace) -> int:
    return trace.index
