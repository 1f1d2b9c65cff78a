"""A pretend engine for pipeline benchmarks: the ``workers.interface.Engine`` contract
with no model, so the worker loop, broker and client are all that costs.

Continuous batching is imitated by a shared step clock: every ``step_s`` all running
requests get their next delta in the same loop iteration, as vLLM's output handler
delivers one step's outputs together. ``step_s = 0`` means an infinitely fast engine:
the relay runs as fast as the pipeline can carry it. At most ``max_num_seqs`` requests
run at once; the rest wait, and show as ``num_waiting`` in the heartbeats.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace

from workers.interface import (
    AdapterRef,
    EngineDelta,
    EngineStats,
    GenerateOptions,
    GenerateParams,
    Prompt,
)

TOKEN_ID = 7
TOKEN_TEXT = " tok"
CHARS_PER_TOKEN = 1.8
"""Tiny-model byte-level BPE on English text: about 1.8 characters per token."""


class FakeEngine:
    def __init__(
        self,
        model_name: str,
        max_num_seqs: int,
        *,
        step_s: float = 0.0,
        tokens_per_step: int = 1,
        prefill_s_per_1k_tokens: float = 0.0,
    ) -> None:
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self.max_loras = 0
        self._step_s = step_s
        self._tokens_per_step = tokens_per_step
        self._prefill_s_per_1k = prefill_s_per_1k_tokens
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._num_running = 0
        self._num_waiting = 0
        self._aborted: set[str] = set()
        self._tick: asyncio.Future[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._generated: deque[tuple[float, int]] = deque()

    async def start(self) -> None:
        if self._step_s > 0:
            self._ticker = asyncio.create_task(self._run_clock())

    async def _run_clock(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self._step_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            tick, self._tick = self._tick, None
            if tick is not None and not tick.done():
                tick.set_result(None)

    async def _next_step(self) -> None:
        if self._step_s <= 0:
            await asyncio.sleep(0)
            return
        if self._tick is None:
            self._tick = asyncio.get_running_loop().create_future()
        await self._tick

    async def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return [TOKEN_ID] * max(1, round(len(text) / CHARS_PER_TOKEN))

    def tokenize(self, prompt: str) -> list[int]:
        return [ord(c) % 32_000 for c in prompt]

    def generate(
        self, request_id: str, prompt: Prompt, params: GenerateParams, options: GenerateOptions
    ) -> AsyncIterator[EngineDelta]:
        deltas = self.deltas(request_id, prompt, params)
        if (options.stream_interval or 1) <= 1:
            return deltas
        return gathered(deltas, options.stream_interval or 1)

    async def deltas(
        self, request_id: str, prompt: Prompt, params: GenerateParams
    ) -> AsyncIterator[EngineDelta]:
        """What ``generate`` streams: a test's engine overrides this, not the contract."""
        num_prompt = (
            len(prompt) if isinstance(prompt, list) else round(len(prompt) / CHARS_PER_TOKEN)
        )
        self._num_waiting += 1
        async with self._slots:
            self._num_waiting -= 1
            self._num_running += 1
            try:
                if self._prefill_s_per_1k:
                    await asyncio.sleep(self._prefill_s_per_1k * num_prompt / 1000)
                produced = 0
                while produced < params.max_tokens:
                    await self._next_step()
                    n = min(self._tokens_per_step, params.max_tokens - produced)
                    produced += n
                    finish = "length" if produced >= params.max_tokens else None
                    if request_id in self._aborted:
                        finish = "abort"
                    self._generated.append((time.monotonic(), n))
                    yield EngineDelta(
                        text=TOKEN_TEXT * n,
                        token_ids=[TOKEN_ID] * n,
                        finish_reason=finish,
                        num_prompt_tokens=num_prompt if produced == n else None,
                        num_cached_tokens=0 if produced == n else None,
                    )
                    if finish is not None:
                        return
            finally:
                self._num_running -= 1
                self._aborted.discard(request_id)

    async def load_adapter(self, adapter: AdapterRef) -> None:
        raise RuntimeError("the fake engine serves no LoRA adapters")

    async def held_adapters(self) -> set[int]:
        return set()

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def stats(self) -> EngineStats:
        horizon = time.monotonic() - 5.0
        while self._generated and self._generated[0][0] < horizon:
            self._generated.popleft()
        return EngineStats(
            num_running=self._num_running,
            num_waiting=self._num_waiting,
            tokens_per_s=sum(n for _, n in self._generated) / 5.0,
        )

    async def shutdown(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()


async def gathered(deltas: AsyncIterator[EngineDelta], interval: int) -> AsyncIterator[EngineDelta]:
    """vLLM's stream interval over a stream of deltas: the first at once, then
    ``interval`` tokens at a time, and the end (a finish or an abort) at once with all it
    held."""
    held: EngineDelta | None = None
    first = True
    try:
        async for delta in deltas:
            held = delta if held is None else _joined(held, delta)
            if first or held.finish_reason is not None or len(held.token_ids) >= interval:
                yield held
                held, first = None, False
    finally:
        aclose = getattr(deltas, "aclose", None)  # a reader that leaves early ends it
        if aclose is not None:
            await aclose()


def _joined(earlier: EngineDelta, later: EngineDelta) -> EngineDelta:
    return replace(
        later,
        text=earlier.text + later.text,
        token_ids=earlier.token_ids + later.token_ids,
        num_prompt_tokens=(
            earlier.num_prompt_tokens
            if earlier.num_prompt_tokens is not None
            else later.num_prompt_tokens
        ),
        num_cached_tokens=(
            earlier.num_cached_tokens
            if earlier.num_cached_tokens is not None
            else later.num_cached_tokens
        ),
    )
