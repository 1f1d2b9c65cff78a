from __future__ import annotations

from bridge.admission import Planner
from bridge.auth import Caller
from bridge.batch_lines import BodyChecker
from bridge.hygiene import PatternScreen
from schemas.batches import LineError, PreparedLine
from tokenbus.batch.lines import InputLine
from tokenbus.prompt_tokens import ChatTemplate, PromptCounter
from tokenbus.tenants import TenantConfig

TENANT = TenantConfig(tenant_id="acme", models=["tiny-llama"])
NO_SYSTEM_ROLE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ m['content'] }}"
    "{% endfor %}"
)


def chat_line(line_no: int, role: str) -> InputLine:
    body = {"model": "tiny-llama", "messages": [{"role": role, "content": "hi"}]}
    return InputLine(
        line_no=line_no, custom_id=f"c{line_no}", url="/v1/chat/completions", body=body
    )


def test_a_line_the_chat_template_refuses_is_that_line_s_error() -> None:
    planner = Planner(
        PatternScreen.create(None, None),
        PromptCounter(None, ChatTemplate(NO_SYSTEM_ROLE, {})),
        max_prompt_chars=10_000,
        knows_model=lambda model: True,
    )
    caller = Caller(tenant=TENANT, credential_id="k", reply_prefix="tokenbus.replies.acme.")
    check = BodyChecker(planner, caller)

    assert isinstance(check(chat_line(1, "user")), PreparedLine)
    assert check(chat_line(2, "system")) == LineError(
        line_no=2, custom_id="c2", code="invalid_value", message="System role not supported"
    )
