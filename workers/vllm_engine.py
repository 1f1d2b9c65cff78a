"""The Engine contract on vLLM's v1 AsyncLLM; the GPU and CPU builds run this same code.

Imported only in the worker environment, where vLLM is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

from vllm import SamplingParams
from vllm import envs as vllm_envs
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind
from vllm.utils.mistral import is_mistral_tokenizer
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import (
    IterationStats,
    MultiModalCacheStats,
    RequestStateStats,
    SchedulerStats,
)

from tokenbus.config import Settings
from tokenbus.procfs import children, thread_ids
from workers.interface import (
    AdapterRef,
    EngineDelta,
    EngineStats,
    EngineTimings,
    GenerateOptions,
    GenerateParams,
    Prompt,
)

GiB = 1 << 30
RATE_WINDOW_S = 5.0


class SchedulerStatsRecorder(StatLoggerBase):
    """Keeps vLLM's latest scheduler stats and a window of generated tokens for heartbeats."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.latest = SchedulerStats()
        self._generated: deque[tuple[float, int]] = deque()  # (monotonic time, tokens)

    # Called by AsyncLLM's output handler, on the event loop, once per engine step.
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.latest = scheduler_stats
        if iteration_stats is not None and iteration_stats.num_generation_tokens:
            self._generated.append((time.monotonic(), iteration_stats.num_generation_tokens))

    def log_engine_initialized(self) -> None:
        pass

    def tokens_per_s(self) -> float:
        # A fixed window, so the rate decays to 0 when the engine goes idle.
        horizon = time.monotonic() - RATE_WINDOW_S
        while self._generated and self._generated[0][0] < horizon:
            self._generated.popleft()
        return sum(n for _, n in self._generated) / RATE_WINDOW_S


def renice_children(nice: int) -> None:
    """Gives every thread of this process's children (vLLM's engine core) ``nice``.

    Linux keeps niceness per thread, and a new thread takes its creator's: threads the
    engine core starts later are niced too, while this process's own stay as they are.
    Raising niceness needs no privilege; a child that has gone is skipped."""
    for child in children(os.getpid()):
        for tid in thread_ids(child):
            with contextlib.suppress(OSError):  # gone meanwhile
                os.setpriority(os.PRIO_PROCESS, tid, nice)


class VllmEngine:
    """Engine backed by vllm.v1 AsyncLLM: continuous batching, prefix cache, priorities."""

    def __init__(
        self,
        model_dir: Path,
        served_model_name: str,
        max_num_seqs: int,
        max_model_len: int,
        dtype: str,
        enforce_eager: bool,
        enable_prefix_caching: bool,
        kv_cache_gib: float,
        engine_nice: int = 0,
        max_loras: int = 0,
        max_cpu_loras: int | None = None,
        max_lora_rank: int = 16,
        stream_interval: int = 1,
    ) -> None:
        self.model_name = served_model_name
        self.max_num_seqs = max_num_seqs
        self.stream_interval = stream_interval
        """Tokens a request's stream gathers before each delta (first and last at once)."""
        self.max_loras = max_loras
        # LoRA only when asked for: vLLM-CPU turns graph compilation off with it, and
        # every step pays for the LoRA kernels even with no adapter in the batch.
        lora: dict[str, object] = (
            {
                "enable_lora": True,
                "max_loras": max_loras,
                "max_cpu_loras": max(max_cpu_loras or max_loras, max_loras),
                "max_lora_rank": max_lora_rank,
            }
            if max_loras
            else {}
        )
        self._args = AsyncEngineArgs(
            model=str(model_dir),
            served_model_name=served_model_name,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            dtype=dtype,  # type: ignore[arg-type]
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            # An engine argument rather than VLLM_CPU_KVCACHE_SPACE: the CPU build reads
            # that variable into this same field, and the GPU build honours only this.
            kv_cache_memory_bytes=int(kv_cache_gib * GiB),
            scheduling_policy="priority",
            # Only our recorder: the default loggers print to the log every few seconds.
            disable_log_stats=True,
            **lora,  # type: ignore[arg-type]
        )
        self._engine_nice = engine_nice
        self._llm: AsyncLLM | None = None
        self._recorder: SchedulerStatsRecorder | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> VllmEngine:
        return cls(
            model_dir=settings.model_dir,
            served_model_name=settings.served_model_name,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=settings.max_model_len,
            dtype=settings.dtype,
            enforce_eager=settings.enforce_eager,
            enable_prefix_caching=settings.enable_prefix_caching,
            kv_cache_gib=settings.kv_cache_gib,
            engine_nice=settings.engine_nice,
            max_loras=settings.max_loras,
            max_cpu_loras=settings.max_cpu_loras,
            max_lora_rank=settings.max_lora_rank,
            stream_interval=settings.stream_interval,
        )

    async def start(self) -> None:
        recorders: list[SchedulerStatsRecorder] = []

        def make_recorder(config: VllmConfig, engine_index: int) -> SchedulerStatsRecorder:
            recorders.append(SchedulerStatsRecorder(config, engine_index))
            return recorders[-1]

        # Loading blocks for many seconds; a thread keeps this loop (and its Kafka
        # heartbeats) alive. AsyncLLM starts its output handler on the first request.
        self._llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, self._args, stat_loggers=[make_recorder]
        )
        if self._engine_nice:
            renice_children(self._engine_nice)
        self._recorder = recorders[0]
        # vLLM reads a VLLM_* variable from the environment at each access until its
        # cache is on, which it turns on in its engine core and executor processes only:
        # in this one the stats of every output read one (5% of this process's CPU at
        # concurrency 64, BENCHMARKS.md). Nothing sets them after the engine started.
        vllm_envs.enable_envs_cache()

    async def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # What vLLM's OpenAI server does for /v1/chat/completions (OnlineRenderer's
        # preprocess_chat), with its own request defaults: the model's chat template with
        # add_generation_prompt, and no special tokens on top of what the template writes.
        llm = self._engine()
        request = ChatCompletionRequest(
            model=self.model_name,
            messages=messages,  # type: ignore[arg-type]
        )
        tokenize = is_mistral_tokenizer(llm.renderer.tokenizer) or bool(
            llm.model_config.enable_prompt_embeds
        )
        chat_params = request.build_chat_params(None, "auto").with_defaults(
            {"tools": None, "tokenize": tokenize}
        )
        tok_params = request.build_tok_params(llm.model_config)
        _, (engine_input,) = await llm.renderer.render_chat_async(
            [messages],  # type: ignore[list-item]
            chat_params,
            tok_params,
        )
        return list(engine_input["prompt_token_ids"])

    def tokenize(self, prompt: str) -> list[int]:
        # As vLLM's input processor does for a text prompt (/v1/completions): the
        # tokenizer's defaults, special tokens included.
        return list(self._engine().get_tokenizer().encode(prompt))

    async def generate(
        self, request_id: str, prompt: Prompt, params: GenerateParams, options: GenerateOptions
    ) -> AsyncIterator[EngineDelta]:
        sampling = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=list(params.stop) or None,
            ignore_eos=params.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            # Made here for this one request and never touched again: vLLM's deep copy
            # of it (as its own OpenAI server, which skips it the same way) would guard
            # nothing, and cost the worker's loop a deepcopy per request.
            skip_clone=True,
            # Per request, so the engine's own interval (1) never holds back a token more.
            stream_interval=options.stream_interval or self.stream_interval,
        )
        engine_prompt: TextPrompt | TokensPrompt = (
            TextPrompt(prompt=prompt)
            if isinstance(prompt, str)
            else TokensPrompt(prompt_token_ids=list(prompt))
        )
        if options.cache_salt is not None:
            # Separates tenants in the prefix cache.
            engine_prompt["cache_salt"] = options.cache_salt
        first = True
        # aclosing: if our caller stops early, vLLM's generator closes now and aborts.
        async with aclosing(
            self._engine().generate(
                engine_prompt,
                sampling,
                request_id,
                priority=options.priority,
                lora_request=_lora_request(options.adapter) if options.adapter else None,
            )
        ) as outputs:
            async for out in outputs:
                completion = out.outputs[0]
                finish_reason = completion.finish_reason if out.finished else None
                token_ids = list(completion.token_ids)
                if not (first or token_ids or completion.text or finish_reason):
                    continue  # an empty step (e.g. text held back for a stop string)
                yield EngineDelta(
                    text=completion.text,
                    token_ids=token_ids,
                    finish_reason=finish_reason,
                    num_prompt_tokens=len(out.prompt_token_ids or ()) if first else None,
                    num_cached_tokens=(out.num_cached_tokens or 0) if first else None,
                    timings=_timings(out.metrics) if finish_reason else None,
                )
                first = False

    async def load_adapter(self, adapter: AdapterRef) -> None:
        if not await self._engine().add_lora(_lora_request(adapter)):
            raise RuntimeError(f"vLLM did not load adapter {adapter.name!r} from {adapter.path}")

    async def held_adapters(self) -> set[int]:
        return set(await self._engine().list_loras())

    async def abort(self, request_id: str) -> None:
        await self._engine().abort(request_id)

    def stats(self) -> EngineStats:
        if self._llm is None or self._recorder is None:
            return EngineStats()
        latest = self._recorder.latest
        # The scheduler reports only when it steps; an abort of the last request leaves
        # no further step, so its last counts would stay stale while the engine idles.
        idle = self._llm.get_num_unfinished_requests() == 0
        return EngineStats(
            num_running=0 if idle else latest.num_running_reqs,
            num_waiting=0 if idle else latest.num_waiting_reqs,
            kv_cache_usage=latest.kv_cache_usage,
            tokens_per_s=self._recorder.tokens_per_s(),
        )

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def _engine(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("VllmEngine.start() has not been called")
        return self._llm


def _lora_request(adapter: AdapterRef) -> LoRARequest:
    return LoRARequest(
        lora_name=adapter.name, lora_int_id=adapter.lora_int_id, lora_path=adapter.path
    )


def _timings(stats: object) -> EngineTimings | None:
    """vLLM's per-request stats (``RequestStateStats``, kept while stats are logged, as
    our recorder makes them) as the engine's times; None when any is missing."""
    if not isinstance(stats, RequestStateStats):
        return None
    times = (stats.queued_ts, stats.scheduled_ts, stats.first_token_ts, stats.last_token_ts)
    if not all(times):
        return None
    return EngineTimings(*times, arrival=stats.arrival_time or None)
