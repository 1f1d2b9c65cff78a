"""The contract between the worker loop and the engine it drives.

The loop calls ``start`` once, then ``generate`` for many requests at once (the engine
batches them continuously), ``abort`` to cancel, and ``stats`` for each heartbeat.
The GPU and the CPU builds of vLLM satisfy it with the same code; tests of pure logic
may use a fake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

Prompt: TypeAlias = str | list[int]
"""Prompt text, or the token ids of one (a chat the engine rendered, or a resumed run)."""


@dataclass(frozen=True)
class EngineTimings:
    """The engine's own times of one request, in seconds on ``time.monotonic()``'s clock
    (vLLM's engine core stamps them so, in its own process)."""

    queued: float
    scheduled: float
    """First scheduled: the end of the wait in the engine's queue."""
    first_token: float
    last_token: float
    arrival: float | None = None
    """When the engine's input processing began (vLLM's ``arrival_time``, stamped on the
    thread that tokenizes a text prompt): on ``time.time()``'s clock, unlike the
    others. None when the engine does not say."""


@dataclass(frozen=True)
class EngineDelta:
    """New output of one request since its previous delta: one engine step's worth, or
    what its stream interval gathered."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """vLLM's own reason on the last delta: ``stop``, ``length`` or ``abort``."""
    num_prompt_tokens: int | None = None
    """Set on the first delta of a request."""
    num_cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache; set on the first delta."""
    timings: EngineTimings | None = None
    """On the last delta, when the engine measured them."""


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


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter for ``generate``: its name, where it lives, and the stable id the
    engine caches it under (the job derives all three from the tenants file)."""

    name: str
    path: str
    lora_int_id: int


@dataclass(frozen=True)
class GenerateOptions:
    """How the engine runs one request, beside its prompt and sampling."""

    priority: int = 0
    """vLLM's priority scheduling: a lower value runs first."""
    cache_salt: str | None = None
    """Separates prefix-cache entries: only requests with the same salt share blocks."""
    adapter: AdapterRef | None = None
    """The LoRA adapter to run with; ``None``: the base model."""
    stream_interval: int | None = None
    """Tokens the request's stream gathers before each delta (its first and its last go
    at once, as does what it holds when it is aborted); ``None``: the engine's own."""


class Engine(Protocol):
    model_name: str
    max_num_seqs: int
    max_loras: int
    """LoRA adapters one step may use; 0: the engine serves the base model only."""

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
        self, request_id: str, prompt: Prompt, params: GenerateParams, options: GenerateOptions
    ) -> AsyncIterator[EngineDelta]:
        """Streams deltas until one carries a finish_reason. Raises on engine failure.
        With ``options.adapter``, the engine loads it if it does not hold it."""

    async def load_adapter(self, adapter: AdapterRef) -> None:
        """Loads an adapter into the engine's adapter cache (evicting the least recently
        used one when full); returns when requests for it can run. Only with LoRA on."""

    async def held_adapters(self) -> set[int]:
        """The ``lora_int_id`` of every adapter the engine holds now."""

    async def abort(self, request_id: str) -> None:
        """Stops a running request; its stream then ends with finish_reason ``abort``."""

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...
