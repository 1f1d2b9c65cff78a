"""Counts a request's prompt tokens for the quota, as the engine will count them.

The rule is ``tokenbus.prompt_tokens``' (vLLM's OpenAI server's), shared with the
bridge. The count is what the quota reserves up front; the worker's real count settles
it. With no tokenizer file at hand it falls back to the UTF-8 byte length, which a
byte-level BPE never exceeds, so the reservation errs on the safe side.
"""

from __future__ import annotations

from pathlib import Path

from schemas import InferenceRequest
from tokenbus.prompt_tokens import PromptCounter as _ModelCounter


class PromptCounter:
    def __init__(self, tokenizer_json: Path) -> None:
        self._counter = _ModelCounter.from_model_dir(tokenizer_json.parent, bytes_per_token=1)

    def count(self, request: InferenceRequest) -> int:
        if request.prompt is not None:
            return self._counter.count_prompt(request.prompt)
        return self._counter.count_chat([(m.role, m.content) for m in request.messages or []])
