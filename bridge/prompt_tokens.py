"""Prompt length in the served model's tokens, for the 413 check before anything is sent.

Uses the model's ``tokenizer.json`` (with its post-processor, so the tiny model's BOS
counts, as it does in vLLM). Chat messages are counted as ``role: content`` lines plus
the assistant cue, which is the tiny model's template and close to most others; the
worker reports the engine's exact count on the last chunk, and usage uses that.
Without a tokenizer file the count falls back to a bytes/4 estimate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

BYTES_PER_TOKEN_ESTIMATE = 4


class PromptCounter:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> PromptCounter:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            log.warning("no %s: prompt lengths are estimated from bytes", path)
            return cls(None)
        return cls(Tokenizer.from_file(str(path)))

    def count_prompt(self, text: str) -> int:
        if self._tokenizer is None:
            return -(-len(text.encode()) // BYTES_PER_TOKEN_ESTIMATE) + 1
        return len(self._tokenizer.encode(text).ids)

    def count_chat(self, messages: Sequence[tuple[str, str]]) -> int:
        rendered = "".join(f"{role}: {content}\n" for role, content in messages) + "assistant: "
        return self.count_prompt(rendered)
