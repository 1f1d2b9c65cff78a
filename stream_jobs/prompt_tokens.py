"""Counts a request's prompt tokens with the served model's own tokenizer.

The count is what the quota reserves up front; the worker's real count settles it. With
no tokenizer file at hand it falls back to the UTF-8 byte length, which a byte-level
BPE never exceeds, so the reservation errs on the safe side.
"""

from __future__ import annotations

import logging
from pathlib import Path

from schemas import InferenceRequest

log = logging.getLogger(__name__)

CHAT_OVERHEAD_TOKENS = 4
"""Per message: the role and separators a chat template adds around the content."""


class PromptCounter:
    def __init__(self, tokenizer_json: Path | None) -> None:
        self._tokenizer = None
        if tokenizer_json is not None and tokenizer_json.exists():
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(tokenizer_json))
        else:
            log.warning("no tokenizer at %s: counting prompt bytes instead", tokenizer_json)

    def count_text(self, text: str) -> int:
        if self._tokenizer is None:
            return len(text.encode("utf-8")) + 1
        return len(self._tokenizer.encode(text).ids)

    def count(self, request: InferenceRequest) -> int:
        if request.prompt is not None:
            return self.count_text(request.prompt)
        messages = request.messages or []
        return 1 + sum(
            self.count_text(m.content) - 1 + CHAT_OVERHEAD_TOKENS + self.count_text(m.role) - 1
            for m in messages
        )
