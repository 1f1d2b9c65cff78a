"""The contract between the worker loop and the engine it drives.

The loop calls ``start`` once, then ``generate`` for many requests at once (the engine
batches them continuously), ``abort`` to cancel, and ``stats`` for each heartbeat.
The GPU and the CPU builds of vLLM satisfy it with the same code; tests of pure logic
may use a fake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class EngineDelta:
    """New output of one request since its previous delta (one engine step's worth)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """vLLM's own reason on the last delta: ``stop``, ``length`` or ``abort``."""
    num_prompt_tokens: int | None = None
    """Set on the first delta of a request."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache; set on the first delta."""


@dataclass(frozen=True)
class EngineStats:
    """What the engine's scheduler last reported."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV-cache blocks in use, 0..1."""
    tokens_per_s: float = 0.0


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


class Engine(Protocol):
    model_name: str
    max_num_seqs: int

    async def start(self) -> None:
        """Loads the model; returns when the engine accepts requests."""

    async def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages -> the prompt token ids vLLM's own OpenAI server gives the engine
        for them: the model's chat template with a generation prompt, and no special
        tokens added on top of what the template writes."""

    def tokenize(self, prompt: str) -> list[int]:
        """Prompt text -> the token ids the engine itself makes of it, special tokens
        included (the rule of vLLM's /v1/completions)."""

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: GenerateParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[EngineDelta]:
        """Streams deltas until one carries a finish_reason. Raises on engine failure."""

    async def abort(self, request_id: str) -> None:
        """Stops a running request; its stream then ends with finish_reason ``abort``."""

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...
