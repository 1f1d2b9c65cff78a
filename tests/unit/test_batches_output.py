from __future__ import annotations

import openai.types
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from batches.output import error_line, output_line
from batches.progress import LineResult
from schemas import FinishReason
from schemas.batches import BatchDoc, FileDoc

RESULT = LineResult(3, "batch_X.3", FinishReason.LENGTH, "hello", 7, 2)


def test_a_chat_line_is_openais_output_line() -> None:
    line = output_line(RESULT, "c-3", "/v1/chat/completions", "tiny-llama", 100)
    data = line.model_dump(mode="json")
    assert data["custom_id"] == "c-3" and data["error"] is None
    assert data["response"]["status_code"] == 200
    body = ChatCompletion.model_validate(data["response"]["body"])
    assert body.choices[0].message.content == "hello"
    assert body.choices[0].finish_reason == "length"
    assert body.usage is not None
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (
        7,
        2,
        9,
    )


def test_a_completion_line_is_a_text_completion() -> None:
    line = output_line(RESULT, "c-3", "/v1/completions", "tiny-llama", 100)
    assert line.response is not None
    body = Completion.model_validate(line.response.body)
    assert body.object == "text_completion" and body.choices[0].text == "hello"


def test_a_failed_line_goes_to_the_error_file() -> None:
    failed = LineResult(
        4, "batch_X.4", FinishReason.ERROR, error_code="engine_error", error_message="boom"
    )
    line = output_line(failed, "c-4", "/v1/completions", "m", 1)
    assert line.response is None and line.error is not None
    assert (line.error.code, line.error.message) == ("engine_error", "boom")
    aborted = output_line(
        LineResult(5, "batch_X.5", FinishReason.ABORT), "c-5", "/v1/completions", "m", 1
    )
    assert aborted.error is not None and aborted.error.code == "aborted"
    assert error_line("batch_X.6", None, "invalid_json", "x").model_dump()["custom_id"] is None


def test_the_documents_are_openais_objects() -> None:
    doc = BatchDoc(
        id="batch_0123456789",
        endpoint="/v1/completions",
        input_file_id="file-0123456789",
        completion_window="24h",
        status="in_progress",
        created_at=1,
        tenant="acme",
    )
    batch = openai.types.Batch.model_validate(doc.model_dump(mode="json"))
    assert batch.request_counts is not None and batch.usage is not None
    file = FileDoc(
        id="file-0123456789", bytes=3, created_at=1, filename="x", purpose="batch", tenant="a"
    )
    assert openai.types.FileObject.model_validate(file.public()).purpose == "batch"
    assert "tenant" not in file.public()
