"""Prompts, tenants and sampling shared by every benchmark. Stdlib only (both envs).

Prompts are deterministic, and the part that varies comes first so that no two prompts
share a cached prefix: a benchmark measures the engine, not the prefix cache.
"""

from __future__ import annotations

_FILLER = (
    "A partition is an ordered, immutable sequence of records that is continually "
    "appended to; each record gets a sequential id called the offset. Consumers "
    "read partitions in order and commit how far they got. "
)


TOKENS_PER_WORD = 3.4
"""Measured with the tiny model's byte-level BPE (vocab 512) on this text."""


def prompt(round_index: int, index: int, num_tokens: int = 150) -> str:
    """A prompt of about ``num_tokens`` tiny-model tokens (within a few percent)."""
    num_words = max(1, round(num_tokens / TOKENS_PER_WORD))
    words = (_FILLER * (1 + num_words // 30)).split()[:num_words]
    return f"[{round_index}:{index}] " + " ".join(words)


def prompts(round_index: int, count: int, num_tokens: int = 150) -> list[str]:
    return [prompt(round_index, i, num_tokens) for i in range(count)]


def tenant(index: int) -> str:
    return f"bench-t{index:04d}"
