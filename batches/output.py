"""A line's result --> its output or error line, in OpenAI's batch format. Pure.

# LineResult (ok) --> OutputLine {response: {status_code 200, body: chat.completion |
#   text_completion with usage}} --> the output file
# LineResult (error), a LineError from submit time, or a line the batch ended without
#   a result --> OutputLine {response: null, error: {code, message}} --> the error file
"""

from __future__ import annotations

from batches.progress import LineResult
from schemas import FinishReason
from schemas.batches import BatchEndpoint, LineErrorBody, LineResponse, OutputLine
from schemas.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    FinishReasonOut,
    Usage,
)


def output_line(
    result: LineResult, custom_id: str, endpoint: BatchEndpoint, model: str, created: int
) -> OutputLine:
    """The line of the output file (``result.ok``) or of the error file."""
    if not result.ok:
        code, message = _error_of(result)
        return error_line(result.request_id, custom_id, code, message)
    usage = Usage(
        prompt_tokens=result.num_prompt_tokens,
        completion_tokens=result.num_completion_tokens,
        total_tokens=result.num_prompt_tokens + result.num_completion_tokens,
    )
    finish: FinishReasonOut = "length" if result.finish_reason is FinishReason.LENGTH else "stop"
    if endpoint == "/v1/chat/completions":
        body = ChatCompletion(
            id=f"chatcmpl-{result.request_id}",
            created=created,
            model=model,
            choices=[
                ChatChoice(message=AssistantMessage(content=result.text), finish_reason=finish)
            ],
            usage=usage,
        ).model_dump(mode="json")
    else:
        body = Completion(
            id=f"cmpl-{result.request_id}",
            created=created,
            model=model,
            choices=[CompletionChoice(text=result.text, finish_reason=finish)],
            usage=usage,
        ).model_dump(mode="json")
    return OutputLine(
        id=f"batch_req_{result.request_id}",
        custom_id=custom_id,
        response=LineResponse(status_code=200, request_id=result.request_id, body=body),
    )


def error_line(request_id: str, custom_id: str | None, code: str, message: str) -> OutputLine:
    return OutputLine(
        id=f"batch_req_{request_id}",
        custom_id=custom_id,
        error=LineErrorBody(code=code, message=message),
    )


def _error_of(result: LineResult) -> tuple[str, str]:
    if result.error_code is not None:
        return result.error_code, result.error_message or result.error_code
    if result.finish_reason is FinishReason.ABORT:
        return "aborted", "the line was aborted while it ran"
    return "line_failed", f"the line ended with finish_reason {result.finish_reason.value}"
