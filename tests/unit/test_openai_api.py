"""The bridge's interactive bodies cannot make a request a batch line: no ``batch_id``."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from bridge.gateway import Bus
from producers import SubmitOptions
from schemas.openai_api import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (ChatCompletionRequest, {"model": "m", "messages": MESSAGES}),
        (CompletionRequest, {"model": "m", "prompt": "hi"}),
    ],
)
def test_a_batch_id_in_an_interactive_body_is_refused_by_name(
    model: type[ChatCompletionRequest | CompletionRequest], body: dict[str, object]
) -> None:
    model.model_validate(body)  # the body alone is fine

    with pytest.raises(ValidationError) as refused:
        model.model_validate({**body, "batch_id": "batch_01"})

    [error] = refused.value.errors()
    assert (error["type"], error["loc"]) == ("extra_forbidden", ("batch_id",))


def test_the_gateway_submits_without_a_batch_id() -> None:
    # The bus the interactive endpoints produce through has no way to name a batch.
    assert "batch_id" not in inspect.signature(Bus.submit).parameters
    assert "batch_id" not in SubmitOptions.__annotations__
