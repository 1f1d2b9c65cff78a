"""Prompt length in the served model's tokens, by the rule vLLM's OpenAI server uses.

- ``/v1/completions``: the prompt text, tokenized with special tokens (the tiny model's
  post-processor prepends ``<s>``).
- ``/v1/chat/completions``: the model's chat template, rendered as transformers renders
  it for vLLM (a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``,
  the special tokens as variables, ``add_generation_prompt`` true), then tokenized
  without special tokens: whatever BOS the template writes is the only one.

The bridge counts with it for its 413 and the token's quota balance, the job for the
quota's reservation; the worker's engine count settles usage. Without a tokenizer file
the count falls back to an estimate from the UTF-8 length.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

log = logging.getLogger(__name__)

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks in transformers; rendering a prompt keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' own: jinja2's built-in tojson escapes HTML characters.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A model's chat template, compiled once."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self._special_tokens = special_tokens

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ChatTemplate | None:
        config = _read_json(model_dir / "tokenizer_config.json")
        source = _template_source(model_dir, config)
        if source is None:
            return None
        special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k)))}
        return cls(source, special)

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        return self._template.render(
            messages=[{"role": role, "content": content} for role, content in messages],
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **self._special_tokens,
        )


class PromptCounter:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        chat_template: ChatTemplate | None = None,
        *,
        bytes_per_token: int = 4,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._bytes_per_token = bytes_per_token

    @classmethod
    def from_model_dir(cls, model_dir: Path, *, bytes_per_token: int = 4) -> PromptCounter:
        """``bytes_per_token`` sets the estimate without a tokenizer file: 1 never
        counts fewer tokens than a byte-level BPE makes (safe for a reservation)."""
        path = model_dir / "tokenizer.json"
        if not path.exists():
            log.warning("no %s: prompt lengths are estimated from bytes", path)
            return cls(None, bytes_per_token=bytes_per_token)
        template = ChatTemplate.from_model_dir(model_dir)
        if template is None:
            log.warning("no chat template in %s: chat prompts are counted as role lines", path)
        return cls(Tokenizer.from_file(str(path)), template, bytes_per_token=bytes_per_token)

    @property
    def exact(self) -> bool:
        """Counts with the model's tokenizer, not the estimate without one."""
        return self._tokenizer is not None

    def count_prompt(self, text: str) -> int:
        """A ``/v1/completions`` prompt: special tokens added."""
        return self._count(text, add_special_tokens=True)

    def count_chat(self, messages: Sequence[tuple[str, str]]) -> int:
        """``(role, content)`` messages of a ``/v1/chat/completions`` request."""
        if self._chat_template is None:
            rendered = "".join(f"{role}: {content}\n" for role, content in messages)
            return self._count(rendered + "assistant: ", add_special_tokens=True)
        return self._count(self._chat_template.render(messages), add_special_tokens=False)

    def _count(self, text: str, *, add_special_tokens: bool) -> int:
        if self._tokenizer is None:
            return -(-len(text.encode()) // self._bytes_per_token) + 1
        # The batch call without offsets: the same ids as ``encode``, for about three
        # quarters of its CPU (the offsets and alignments a count never reads).
        (encoding,) = self._tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        return len(encoding)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
    """Where transformers finds it: ``chat_template.jinja``, then the tokenizer config
    (a string, or named templates of which ``default`` is used)."""
    path = model_dir / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                source = entry.get("template")
                return source if isinstance(source, str) else None
    return None


def _token_text(token: object) -> str | None:
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return str(token["content"])
    return None
