from __future__ import annotations

from typing import Literal

import msgspec
import orjson

from bridge.errors import ApiError
from bridge.relay import DONE, Relay, sse, sse_error
from schemas import FinishReason
from schemas.openai_api import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
)
from tokenbus.chunks import Chunk


def chunk(seq: int, text: str, n: int = 1, **fields: object) -> Chunk:
    return msgspec.convert(
        {"request_id": "req_1", "tenant_id": "t", "seq": seq, "text": text, "num_tokens": n}
        | fields,
        Chunk,
    )


def data(event: bytes | None) -> dict[str, object]:
    assert event is not None and event.startswith(b"data: ") and event.endswith(b"\n\n")
    return dict(orjson.loads(event[6:]))


def test_chat_stream_role_first_then_content_then_finish_and_usage() -> None:
    relay = Relay("chat", "req_1", "tiny-llama", num_prompt_tokens=3)
    chunks = [
        chunk(0, "Hel"),
        chunk(1, "", 1),  # a token still decoding: no event
        chunk(2, "lo", 1, finish_reason="length", num_prompt_tokens=5),
    ]
    events = []
    for c in chunks:
        relay.add(c)
        events.append(relay.event(c))
    assert events[1] is None
    first, last = data(events[0]), data(events[2])
    assert first["id"] == "chatcmpl-req_1" and first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "Hel"},
            "finish_reason": None,
            "logprobs": None,
        }
    ]
    assert last["choices"][0]["delta"] == {"role": None, "content": "lo"}  # type: ignore[index]
    assert last["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    usage = data(relay.usage_event())
    assert usage["choices"] == []
    # The worker's count replaces the bridge's estimate.
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_whole_responses_in_both_shapes() -> None:
    for kind, obj in (("chat", "chat.completion"), ("text", "text_completion")):
        relay = Relay(kind, "req_1", "m", num_prompt_tokens=2)  # type: ignore[arg-type]
        relay.add(chunk(0, "a"))
        relay.add(chunk(1, "b", finish_reason=FinishReason.STOP))
        body = relay.response().model_dump(mode="json")
        assert body["object"] == obj
        assert body["usage"]["completion_tokens"] == 2
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert (choice["message"]["content"] if kind == "chat" else choice["text"]) == "ab"


def test_sse_framing_and_error_event() -> None:
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    error = ApiError(504, "no chunk", type="server_error", code="timeout")
    assert data(sse_error(error)) == {
        "error": {"message": "no chunk", "type": "server_error", "param": None, "code": "timeout"}
    }
    assert DONE == b"data: [DONE]\n\n"


def test_every_token_event_is_the_models_own_dump() -> None:
    """Mid-stream events reuse one dump per response; each must equal the model's."""
    for kind in ("chat", "text"):
        relay = Relay(kind, "req_1", "m", num_prompt_tokens=2)
        texts = ["a", 'b"c', "\u00fc\n", "\\ \x00\x1f\u2028 \U0001f600", "d"]
        for seq, text in enumerate(texts):
            finish = FinishReason.STOP if seq == len(texts) - 1 else None
            c = chunk(seq, text, finish_reason=finish)
            relay.add(c)
            out_finish: Literal["stop"] | None = "stop" if finish else None
            expected: Completion | ChatCompletionChunk
            if kind == "text":
                choice = CompletionChoice(text=text, finish_reason=out_finish)
                expected = Completion(
                    id=relay.id, created=relay.created, model="m", choices=[choice]
                )
            else:
                delta = ChatDelta(role=None if seq else "assistant", content=text)
                expected = ChatCompletionChunk(
                    id=relay.id,
                    created=relay.created,
                    model="m",
                    choices=[ChatChunkChoice(delta=delta, finish_reason=out_finish)],
                )
            assert relay.event(c) == sse(expected)
