"""OpenAI's request and response bodies, as far as the bridge speaks them (and a batch's
output lines carry them).

Requests are strict and closed (``extra="forbid"``): an unsupported parameter gets a
400 naming it, never a silent ignore. Responses are built through these models, and
the OpenAPI spec (``bridge.openapi``) is generated from them, so the two cannot drift.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MAX_SEED = 2**63 - 1


def _integral(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer; strict pydantic would not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integral = BeforeValidator(_integral)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: Annotated[str, Field(max_length=64)] | None = None

    def text(self) -> str:
        # Text parts are joined by newlines, as vLLM's server does for templates that
        # take a message's content as one string.
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


StopStrings = (
    Annotated[str, Field(min_length=1, max_length=256)]
    | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)]
)


class _Generation(_Body):
    model: Annotated[str, Field(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Field(ge=1, le=131_072), Integral] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=1), Integral] | None = None
    """Only one choice per request."""
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopStrings | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED), Integral] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    """Accepted for compatibility; the tenant and session identify the caller."""
    ignore_eos: bool | None = None
    """vLLM's extension: generate ``max_tokens`` even past end-of-sequence."""

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1, max_length=2048)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=131_072), Integral] | None = None


class CompletionRequest(_Generation):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    """One prompt per request; a list must hold exactly one."""

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# -- responses --------------------------------------------------------------------------
FinishReasonOut = Literal["stop", "length"]


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReasonOut
    logprobs: None = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Out):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReasonOut | None = None
    logprobs: None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Out):
    index: int = 0
    text: str
    finish_reason: FinishReasonOut | None = None
    logprobs: None = None


class Completion(_Out):
    """Both the whole response and each streamed chunk (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenbus"


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class Health(_Out):
    status: Literal["ok", "starting"]
    reply_topic: str
