"""A batch line's body, checked as ``/v1/chat/completions`` or ``/v1/completions`` would check
it for the same caller: the bridge's request types and its planner (model access,
model known, prompt size in characters and, through the one shared prompt counter, in
tokens, content policy, output length).

# InputLine + Caller --> ChatCompletionRequest | CompletionRequest --> Planner --> PreparedLine
# a validation or planner refusal --> LineError (code and message as the API's)
"""

from __future__ import annotations

from pydantic import ValidationError

from bridge.admission import Planner
from bridge.auth import Caller
from bridge.errors import ApiError
from bridge.gateway import _invalid_body
from schemas.batches import LineError, PreparedLine
from schemas.openai_api import ChatCompletionRequest, CompletionRequest
from tokenbus.batch.lines import InputLine


class BodyChecker:
    def __init__(self, planner: Planner, caller: Caller) -> None:
        self._planner = planner
        self._caller = caller

    def __call__(self, line: InputLine) -> PreparedLine | LineError:
        try:
            if line.url == "/v1/chat/completions":
                plan = self._planner.plan_chat(
                    ChatCompletionRequest.model_validate(line.body), self._caller
                )
            else:
                plan = self._planner.plan_completion(
                    CompletionRequest.model_validate(line.body), self._caller
                )
        except ValidationError as exc:
            error = _invalid_body(exc)
            return _line_error(line, error.code or "invalid_body", error.message)
        except ApiError as exc:
            return _line_error(line, exc.code or exc.type, exc.message)
        return PreparedLine(
            line_no=line.line_no,
            custom_id=line.custom_id,
            model=plan.model,
            prompt=plan.prompt,
            messages=plan.messages,
            sampling=plan.sampling,
            flags=list(plan.flags),
        )


def _line_error(line: InputLine, code: str, message: str) -> LineError:
    return LineError(line_no=line.line_no, custom_id=line.custom_id, code=code, message=message)
