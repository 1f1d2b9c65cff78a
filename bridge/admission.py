"""An OpenAI request body + its caller --> what goes on the bus, or the reason it can't.

Pure: no I/O. The checks run in the order a client can act on: model access (403),
then whether the model exists (404; after access, so that a tenant learns nothing of
the models it may not use), prompt size in characters, then in tokens (413; a chat
template that refuses the messages, as ``raise_exception`` does, is a 400), content
screening of a normalized copy (flag or 400; the prompt itself goes on as sent, see
``bridge.hygiene``), output length (capped to the tenant's limit, flagged), the token's
quota balance (429).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jinja2

from bridge.auth import Caller
from bridge.errors import (
    invalid_request,
    model_not_allowed,
    model_not_found,
    too_large,
)
from bridge.hygiene import PatternScreen, pass_text, rewrite_text
from schemas import ChatMessage, SamplingParams
from schemas.openai_api import ChatCompletionRequest, CompletionRequest
from tokenbus.prompt_tokens import PromptCounter

CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CAPPED_FLAG = "max_tokens_capped"


@dataclass(frozen=True)
class Plan:
    model: str
    sampling: SamplingParams
    priority: int
    num_prompt_tokens: int
    """The prompt's length in the model's tokens (``prompt_tokens_exact``: counted with
    its tokenizer; else the estimate without one)."""
    stream: bool
    include_usage: bool
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    flags: list[str] = field(default_factory=list)
    prompt_tokens_exact: bool = False


class Planner:
    def __init__(
        self,
        screen: PatternScreen,
        counter: PromptCounter,
        *,
        max_prompt_chars: int,
        knows_model: Callable[[str], bool],
    ) -> None:
        self._screen = screen
        self._counter = counter
        self._max_prompt_chars = max_prompt_chars
        self._knows_model = knows_model

    def plan_chat(self, body: ChatCompletionRequest, caller: Caller) -> Plan:
        self._check_model(body.model, caller)
        prepare = _prepare(caller)
        messages = [
            ChatMessage(
                role="system" if m.role == "developer" else m.role, content=prepare(m.text())
            )
            for m in body.messages
        ]
        texts = [m.content for m in messages]
        self._check_chars(texts, "messages")
        try:
            num_prompt = self._counter.count_chat([(m.role, m.content) for m in messages])
        except jinja2.TemplateError as exc:
            # The model's template refuses these messages (roles out of order, a role it
            # does not know): the engine would refuse them too, so it is the client's 400.
            raise invalid_request(
                str(exc) or "The model's chat template refused the messages.", "messages"
            ) from None
        requested = body.max_completion_tokens or body.max_tokens
        return self._plan(
            body, caller, texts, num_prompt, requested, CHAT_DEFAULT_MAX_TOKENS, messages=messages
        )

    def plan_completion(self, body: CompletionRequest, caller: Caller) -> Plan:
        self._check_model(body.model, caller)
        prompt = _prepare(caller)(body.prompt_text())
        self._check_chars([prompt], "prompt")
        num_prompt = self._counter.count_prompt(prompt)
        return self._plan(
            body, caller, [prompt], num_prompt, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS,
            prompt=prompt,
        )  # fmt: skip

    def _plan(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        caller: Caller,
        texts: list[str],
        num_prompt: int,
        requested: int | None,
        default_max_tokens: int,
        *,
        prompt: str | None = None,
        messages: list[ChatMessage] | None = None,
    ) -> Plan:
        """The steps after counting, the same for both endpoints: the content screen,
        then the sampling limits."""
        param = "messages" if messages is not None else "prompt"
        flags = self._screen_texts(texts, caller, param)
        sampling, more_flags = _sampling(body, caller, num_prompt, requested, default_max_tokens)
        return Plan(
            model=body.model,
            sampling=sampling,
            priority=caller.tenant.priority_class,
            num_prompt_tokens=num_prompt,
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            prompt=prompt,
            messages=messages,
            flags=flags + more_flags,
            prompt_tokens_exact=self._counter.exact,
        )

    def _check_model(self, model: str, caller: Caller) -> None:
        if not caller.tenant.may_use(model):
            raise model_not_allowed(model)
        if not self._knows_model(model):
            raise model_not_found(model)

    def _check_chars(self, texts: list[str], param: str) -> None:
        num_chars = sum(len(t) for t in texts)
        if num_chars > self._max_prompt_chars:
            raise too_large(
                f"The prompt has {num_chars} characters; at most {self._max_prompt_chars} "
                "are accepted.",
                param,
                "prompt_too_large",
            )

    def _screen_texts(self, texts: list[str], caller: Caller, param: str) -> list[str]:
        findings = self._screen.scan(texts)
        if findings and caller.tenant.injection_policy == "block":
            kinds = ", ".join(f.flag for f in findings)
            raise invalid_request(
                f"The request was blocked by your tenant's content policy ({kinds}).",
                param,
                code="content_blocked",
            )
        return [f.flag for f in findings]


def _prepare(caller: Caller) -> Callable[[str], str]:
    """The text the engine gets: as sent, unless the tenant asked for it rewritten."""
    return rewrite_text if caller.tenant.rewrite_prompts else pass_text


def _sampling(
    body: ChatCompletionRequest | CompletionRequest,
    caller: Caller,
    num_prompt: int,
    requested: int | None,
    default_max_tokens: int,
) -> tuple[SamplingParams, list[str]]:
    tenant = caller.tenant
    if num_prompt > tenant.max_prompt_tokens:
        raise too_large(
            f"The prompt has {num_prompt} tokens; your tenant allows at most "
            f"{tenant.max_prompt_tokens}.",
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            "context_length_exceeded",
        )
    flags: list[str] = []
    max_tokens = requested if requested is not None else default_max_tokens
    if max_tokens > tenant.max_output_tokens:
        max_tokens = tenant.max_output_tokens
        if requested is not None:  # only a limit the client asked for is worth a flag
            flags.append(CAPPED_FLAG)
    # A token's quota_balance is in cost units, over the token's life: the job holds
    # what it spent, so the job refuses (insufficient_quota), not the bridge.
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
        ignore_eos=bool(body.ignore_eos),
    )
    return sampling, flags
