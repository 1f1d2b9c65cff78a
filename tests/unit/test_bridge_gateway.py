from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from starlette.requests import Request
from starlette.types import Message

from bridge.errors import ApiError
from bridge.gateway import ClientGone, Gateway
from schemas.openai_api import CompletionRequest
from tokenbus.config import Settings

BODY = b'{"model": "tiny-llama", "prompt": "hi"}'


def gateway(**settings: Any) -> Gateway:
    # read_body needs only the settings; the other parts are never called.
    none: Any = None
    return Gateway(Settings(**settings), none, none, none, none, none, none, none)


def request(*messages: Message, then_wait: bool = True) -> Request:
    """An HTTP request whose body arrives as ``messages``; then nothing (or a disconnect)."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            message = pending.pop(0)
            if message["type"] == "sleep":
                await asyncio.sleep(message["s"])
                return await receive()
            return message
        if then_wait:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    http = Request({"type": "http", "method": "POST", "headers": []}, receive)
    http.state.ids = {"X-Request-ID": "req_test"}
    return http


def part(body: bytes, more: bool = True) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_a_whole_body_is_parsed() -> None:
    http = request(part(BODY[:10]), part(BODY[10:], more=False))
    body = await gateway().read_body(http, CompletionRequest)
    assert body.model == "tiny-llama"


async def test_a_body_that_stops_halfway_is_a_408_that_closes_the_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "bridge.gateway")
    started = time.monotonic()
    with pytest.raises(ApiError) as caught:
        await gateway(bridge_body_read_timeout_s=0.2).read_body(
            request(part(BODY[:10])), CompletionRequest
        )
    assert 0.2 <= time.monotonic() - started < 1.0
    assert caught.value.status == 408
    assert caught.value.body()["error"]["code"] == "request_timeout"
    assert caught.value.headers["Connection"] == "close"
    assert [r.levelname for r in caplog.records] == ["INFO"]


async def test_a_trickle_does_not_extend_the_deadline() -> None:
    trickle = [m for byte in BODY[:-1] for m in (part(bytes([byte])), {"type": "sleep", "s": 0.02})]
    started = time.monotonic()
    with pytest.raises(ApiError) as caught:
        await gateway(bridge_body_read_timeout_s=0.3).read_body(
            request(*trickle), CompletionRequest
        )
    assert caught.value.status == 408
    assert time.monotonic() - started < 0.6  # the whole trickle would take ~0.8 s


async def test_a_client_that_closes_mid_body_is_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ClientGone):
        await gateway().read_body(request(part(BODY[:10]), then_wait=False), CompletionRequest)
    assert [(r.levelname, r.exc_info) for r in caplog.records] == [("INFO", None)]
    assert "req_test" in caplog.records[0].getMessage()


async def test_an_oversized_body_is_still_a_413() -> None:
    with pytest.raises(ApiError) as caught:
        await gateway(bridge_max_body_bytes=8).read_body(
            request(part(BODY, more=False)), CompletionRequest
        )
    assert caught.value.status == 413
