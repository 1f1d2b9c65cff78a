"""VllmEngine against a real vLLM engine serving the tiny random-weight model.

Runs in the worker environment: /tmp/venvs/worker/bin/python -m pytest tests/worker
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import pytest_asyncio

from tests.fidelity_corpus import CHATS, PROMPTS
from tokenbus.prompt_tokens import PromptCounter
from workers.interface import EngineDelta, GenerateOptions, GenerateParams
from workers.tiny_model import build_tiny_model
from workers.vllm_engine import VllmEngine

TIMEOUT_S = 60
NUM_PROMPT_TOKENS = 300  # more than two of the CPU build's 128-token cache blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(model_dir: Path) -> AsyncIterator[VllmEngine]:
    engine = VllmEngine(
        model_dir,
        served_model_name="tiny",
        max_num_seqs=32,
        max_model_len=4096,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_gib=1,
    )
    await engine.start()
    yield engine
    await engine.shutdown()


def joined(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def unique_prompt(seed: int) -> list[int]:
    # Distinct per test, so one test's cached blocks never serve another's prompt.
    return [2 + (seed * 131 + i * 7) % 500 for i in range(NUM_PROMPT_TOKENS)]


async def collect(
    engine: VllmEngine,
    prompt: str | list[int],
    params: GenerateParams,
    *,
    cache_salt: str | None = None,
) -> list[EngineDelta]:
    request_id = uuid.uuid4().hex
    async with asyncio.timeout(TIMEOUT_S):
        stream = engine.generate(request_id, prompt, params, GenerateOptions(cache_salt=cache_salt))
        return [delta async for delta in stream]


def cuts(deltas: list[EngineDelta]) -> list[int]:
    """How many tokens the stream had sent after each delta."""
    return list(itertools.accumulate(len(d.token_ids) for d in deltas))


async def test_deltas_add_up_to_max_tokens(engine: VllmEngine) -> None:
    params = GenerateParams(max_tokens=24, ignore_eos=True)
    prompts = [f"request {i} begins here" for i in range(8)]

    runs = await asyncio.gather(*(collect(engine, p, params) for p in prompts))

    for deltas in runs:
        assert sum(len(d.token_ids) for d in deltas) == 24
        assert [d.finish_reason for d in deltas][-1] == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[0].num_prompt_tokens and deltas[0].num_prompt_tokens > 0
        assert all(d.num_prompt_tokens is None for d in deltas[1:])


async def test_token_prompt_counts_its_tokens(engine: VllmEngine) -> None:
    prompt = unique_prompt(seed=1)[:50]

    deltas = await collect(engine, prompt, GenerateParams(max_tokens=5, ignore_eos=True))

    assert deltas[0].num_prompt_tokens == 50
    assert sum(len(d.token_ids) for d in deltas) == 5


async def test_repeated_prompt_reuses_prefix_cache(engine: VllmEngine) -> None:
    prompt = unique_prompt(seed=2)
    params = GenerateParams(max_tokens=4, ignore_eos=True)

    first = await collect(engine, prompt, params)
    again = await collect(engine, prompt, params)

    assert first[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens is not None and again[0].num_cached_tokens > 0


async def test_cache_salt_isolates_tenants(engine: VllmEngine) -> None:
    prompt = unique_prompt(seed=3)
    params = GenerateParams(max_tokens=4, ignore_eos=True)
    await collect(engine, prompt, params)  # cached without a salt

    salted = await collect(engine, prompt, params, cache_salt="tenant-a")
    other_salt = await collect(engine, prompt, params, cache_salt="tenant-b")
    same_salt = await collect(engine, prompt, params, cache_salt="tenant-a")

    assert salted[0].num_cached_tokens == 0
    assert other_salt[0].num_cached_tokens == 0
    assert same_salt[0].num_cached_tokens is not None and same_salt[0].num_cached_tokens > 0


async def test_each_request_has_sampling_params_of_its_own_that_vllm_does_not_copy(
    engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = engine._engine()
    generate = llm.generate
    seen: list[object] = []

    def spy(prompt: object, sampling_params: object, *args: object, **kwargs: object) -> object:
        seen.append(sampling_params)
        return generate(prompt, sampling_params, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llm, "generate", spy)
    params = GenerateParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    streams = [await collect(engine, text, params) for text in ("one", "two")]
    assert [sum(len(d.token_ids) for d in deltas) for deltas in streams] == [5, 5]
    first, second = seen
    assert first is not second  # nothing shared between requests for a copy to protect
    assert getattr(first, "skip_clone", False) and getattr(second, "skip_clone", False)


async def test_a_stream_interval_gathers_tokens_but_sends_the_first_and_last_at_once(
    engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = unique_prompt(41)
    params = GenerateParams(max_tokens=22, ignore_eos=True, temperature=0.0)
    # Salted apart, so both prefill the prompt afresh.
    each = await collect(engine, prompt, params, cache_salt="each")
    monkeypatch.setattr(engine, "stream_interval", 8)
    gathered = await collect(engine, prompt, params, cache_salt="gathered")

    # The first token goes at once, then 8 at a time, and the rest at the end. vLLM merges
    # outputs its consumer has not taken yet, so a slow consumer sees fewer deltas but
    # never a cut anywhere else.
    assert set(cuts(gathered)) <= {1, 9, 17, 22} and cuts(gathered)[-1] == 22
    assert cuts(each)[-1] == 22 and len(each) > 4  # every step sends
    assert set(cuts(each)) - {1, 9, 17, 22}  # cuts the interval of 8 would not make
    assert [t for d in gathered for t in d.token_ids] == [t for d in each for t in d.token_ids]
    assert "".join(d.text for d in gathered) == "".join(d.text for d in each)
    assert gathered[0].num_prompt_tokens == each[0].num_prompt_tokens == NUM_PROMPT_TOKENS
    assert gathered[-1].finish_reason == each[-1].finish_reason == "length"


async def test_an_aborted_stream_sends_what_its_interval_held_and_it_is_the_greedy_run(
    engine: VllmEngine,
) -> None:
    """A batch line paused for interactive work goes on from every token it made: vLLM's
    answer to the abort carries the tokens its stream interval was holding."""
    prompt = unique_prompt(43)
    request_id = uuid.uuid4().hex
    params = GenerateParams(max_tokens=3000, ignore_eos=True, temperature=0.0)
    options = GenerateOptions(cache_salt="held", stream_interval=1024)
    deltas: list[EngineDelta] = []
    async with asyncio.timeout(TIMEOUT_S):
        async for delta in engine.generate(request_id, prompt, params, options):
            deltas.append(delta)
            if len(deltas) == 1:
                await asyncio.sleep(0.3)  # steps go on; the interval holds their tokens
                await engine.abort(request_id)

    first, last = deltas  # the first token at once, then everything held with the abort
    assert len(first.token_ids) == 1 and last.finish_reason == "abort"
    assert len(last.token_ids) > 1, "no token was held when the abort came"
    made = first.token_ids + last.token_ids
    greedy = GenerateParams(max_tokens=len(made), ignore_eos=True, temperature=0.0)
    each = await collect(engine, prompt, greedy, cache_salt="each-held")
    assert [t for d in each for t in d.token_ids] == made
    assert first.text + last.text == "".join(d.text for d in each)


async def test_abort_ends_stream_with_abort(engine: VllmEngine) -> None:
    request_id = uuid.uuid4().hex
    params = GenerateParams(max_tokens=3000, ignore_eos=True)
    deltas: list[EngineDelta] = []

    async with asyncio.timeout(TIMEOUT_S):
        async for delta in engine.generate(request_id, "abort me", params, GenerateOptions()):
            deltas.append(delta)
            if len(deltas) == 2:
                await engine.abort(request_id)

    assert deltas[-1].finish_reason == "abort"
    # Within one engine step: at most the step already under way adds a token.
    assert sum(len(d.token_ids) for d in deltas[2:]) <= 1, [d.token_ids for d in deltas]


async def test_stats_show_running_requests_under_load(engine: VllmEngine) -> None:
    params = GenerateParams(max_tokens=64, ignore_eos=True)
    seen_running: list[int] = []

    async def sample() -> None:
        while True:
            seen_running.append(engine.stats().num_running)
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(collect(engine, f"load {i}", params) for i in range(8)))
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler

    assert max(seen_running) > 0
    assert engine.stats().num_running == 0
    assert engine.stats().tokens_per_s > 0


async def test_render_chat_uses_the_model_template_without_an_extra_bos(
    engine: VllmEngine,
) -> None:
    """As vLLM's /v1/chat/completions: the template's text, tokenized without special
    tokens, so the tiny model's post-processor adds no <s> the template did not write."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = "system: be brief\nuser: hi\nassistant: "

    ids = await engine.render_chat(messages)

    with_bos = engine.tokenize(text)
    assert with_bos[0] == 0  # <s>
    assert ids == with_bos[1:]
    deltas = await collect(engine, ids, GenerateParams(max_tokens=1, ignore_eos=True))
    assert deltas[0].num_prompt_tokens == len(ids)


async def test_the_shared_prompt_counter_counts_as_the_engine_renders(
    engine: VllmEngine, model_dir: Path
) -> None:
    """The bridge and the job count prompts without vLLM; their count must be the
    engine's, for every text a serving layer is tempted to rewrite."""
    counter = PromptCounter.from_model_dir(model_dir)
    for name, messages in CHATS.items():
        # Text parts travel joined by newlines (schemas.openai_api), as vLLM joins them.
        pairs = [(m["role"], joined(m["content"])) for m in messages]
        assert counter.count_chat(pairs) == len(await engine.render_chat(messages)), name
    for name, prompt in PROMPTS.items():
        assert counter.count_prompt(prompt) == len(engine.tokenize(prompt)), name


async def test_tokenize_matches_what_the_engine_makes_of_text(engine: VllmEngine) -> None:
    text = "The quick brown fox jumps over the lazy dog, twice over."
    ids = engine.tokenize(text)
    deltas = await collect(engine, text, GenerateParams(max_tokens=1, ignore_eos=True))
    assert deltas[0].num_prompt_tokens == len(ids) > 10


async def test_prompt_plus_delivered_ids_continues_the_same_greedy_stream(
    engine: VllmEngine,
) -> None:
    """What failover relies on: resuming from the prompt ids plus the ids already
    delivered yields exactly the rest of the stream an uninterrupted run yields."""
    text = "resume me " * 12
    greedy = GenerateParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    whole = [t for d in await collect(engine, text, greedy) for t in d.token_ids]
    assert len(whole) == 24
    delivered = whole[:9]
    rest = GenerateParams(max_tokens=15, temperature=0.0, ignore_eos=True)
    resumed = await collect(engine, engine.tokenize(text) + delivered, rest)
    assert delivered + [t for d in resumed for t in d.token_ids] == whole


async def test_vllm_reads_its_environment_once_after_start(engine: VllmEngine) -> None:
    """vLLM caches its VLLM_* variables in the engine core only; in the worker's process
    the stats of each output read one from the environment until the worker caches them."""
    import vllm.envs

    assert hasattr(vllm.envs.__getattr__, "cache_clear")
