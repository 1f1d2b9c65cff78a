"""Chunks --> OpenAI's response bodies and SSE events. Pure: no I/O.

One ``Relay`` per request knows the response's id, model and kind (chat or text),
turns each chunk into the matching OpenAI chunk, and sums what the whole response
needs (text, completion tokens, the engine's prompt count, the finish reason).
"""

from __future__ import annotations

import time
from typing import Literal

import orjson
from pydantic import BaseModel

from bridge.errors import ApiError
from schemas import FinishReason
from schemas.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    FinishReasonOut,
    Usage,
)
from tokenbus.chunks import Chunk

Kind = Literal["chat", "text"]
DONE = b"data: [DONE]\n\n"
HEARTBEAT = b": keep-alive\n\n"
_MARK = "\x00tokenbus-text\x00"
"""Stands for a token event's text while its response's template is made."""


def sse(model: BaseModel | dict[str, object]) -> bytes:
    body = model.model_dump(mode="json") if isinstance(model, BaseModel) else model
    return b"data: " + orjson.dumps(body) + b"\n\n"


def sse_error(error: ApiError) -> bytes:
    return sse(error.body())


def _finish(reason: FinishReason | None) -> FinishReasonOut | None:
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


class Relay:
    def __init__(self, kind: Kind, request_id: str, model: str, num_prompt_tokens: int):
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        """The bridge's own count until the worker's last chunk reports the engine's."""
        self.num_completion_tokens = 0
        self.finish_reason: FinishReasonOut | None = None
        self._parts: list[str] = []
        self._sent_role = False
        self._token_template: tuple[bytes, bytes] | None = None

    def add(self, chunk: Chunk) -> None:
        self.num_completion_tokens += chunk.num_tokens
        self._parts.append(chunk.text)
        if chunk.num_prompt_tokens is not None:
            self.num_prompt_tokens = chunk.num_prompt_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = _finish(chunk.finish_reason)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
            total_tokens=self.num_prompt_tokens + self.num_completion_tokens,
        )

    # -- streaming ----------------------------------------------------------------------
    def event(self, chunk: Chunk) -> bytes | None:
        """The SSE event for one (already added) chunk; None when it carries nothing."""
        finish = _finish(chunk.finish_reason)
        if not chunk.text and finish is None and (self._sent_role or self.kind == "text"):
            return None  # tokens still decoding to text (a split UTF-8 sequence)
        if finish is None and (self._sent_role or self.kind == "text"):
            return self._token_event(chunk.text)
        if self.kind == "text":
            return sse(self._completion([CompletionChoice(text=chunk.text, finish_reason=finish)]))
        delta = ChatDelta(role=None if self._sent_role else "assistant", content=chunk.text or None)
        self._sent_role = True
        choice = ChatChunkChoice(delta=delta, finish_reason=finish)
        return sse(
            ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[choice]
            )
        )

    def _token_event(self, text: str) -> bytes:
        """The common event, a token mid-stream: the bytes of the models' own dump,
        made once per response, around the text's JSON string (orjson writes a string
        the same alone as inside an object). A third of the bridge's CPU per token went
        to building and dumping the models for every token."""
        if self._token_template is None:
            self._token_template = self._make_token_template()
        head, tail = self._token_template
        return head + orjson.dumps(text) + tail

    def _make_token_template(self) -> tuple[bytes, bytes]:
        if self.kind == "text":
            model: BaseModel = self._completion([CompletionChoice(text=_MARK, finish_reason=None)])
        else:
            choice = ChatChunkChoice(delta=ChatDelta(content=_MARK), finish_reason=None)
            model = ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[choice]
            )
        head, mark, tail = sse(model).partition(orjson.dumps(_MARK))
        assert mark and orjson.dumps(_MARK) not in tail, "the text's place is not unique"
        return head, tail

    def usage_event(self) -> bytes:
        """OpenAI's final chunk for ``stream_options.include_usage``: no choices, usage."""
        if self.kind == "text":
            return sse(self._completion([], usage=self.usage))
        return sse(
            ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage
            )
        )

    # -- whole responses -----------------------------------------------------------------
    def response(self) -> BaseModel:
        text = "".join(self._parts)
        finish: FinishReasonOut = self.finish_reason or "stop"
        if self.kind == "text":
            return self._completion(
                [CompletionChoice(text=text, finish_reason=finish)], usage=self.usage
            )
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)],
            usage=self.usage,
        )

    def _completion(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )
