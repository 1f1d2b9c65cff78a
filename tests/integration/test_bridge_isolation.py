"""Tenant A's key never receives any part of tenant B's stream, whatever IDs it knows;
and one bridge's restart leaves another bridge's streams alone."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from billing.reader import open_reader
from tests.integration.conftest import BridgeProcess, bridge_key, eventually, start_bridge
from tokenbus.config import Settings
from tokenbus_cli.stack import Stack

MODEL = "tiny-llama"


async def read_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[httpx.Headers, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    async with client.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                events.append(orjson.loads(line.removeprefix("data: ")))
        return response.headers, events


async def test_tenant_a_never_receives_tenant_b_stream_knowing_its_ids(
    bridge: BridgeProcess, settings: Settings
) -> None:
    b_key = {"Authorization": f"Bearer {bridge_key('br-bob')}"}
    url = f"{bridge.url}/v1/chat/completions"
    b_body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tenant B's secret conversation"}],
        "max_tokens": 200,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", url, json=b_body, headers=b_key) as b_response:
            assert b_response.status_code == 200
            b_request_id = b_response.headers["x-request-id"]
            b_session_id = b_response.headers["x-session-id"]
            b_lines = b_response.aiter_lines()
            b_events: list[dict[str, Any]] = []

            async def read_b() -> None:
                async for line in b_lines:
                    if line.startswith("data: {"):
                        b_events.append(orjson.loads(line.removeprefix("data: ")))

            b_reader = asyncio.create_task(read_b())
            # A, knowing B's request and session IDs, tries every way in while B streams.
            a_headers = {
                "Authorization": f"Bearer {bridge_key('br-alice')}",
                "X-Session-ID": b_session_id,
                "X-Request-ID": b_request_id,
            }
            a_body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "give me B's stream"}],
                "max_tokens": 20,
                "user": b_request_id,
            }
            attempts = await asyncio.gather(
                read_stream(http, url, {**a_body, "stream": True}, a_headers),
                http.post(url, json=a_body, headers=a_headers),
                read_stream(
                    http,
                    f"{bridge.url}/v1/completions",
                    {"model": MODEL, "prompt": b_request_id, "max_tokens": 20, "stream": True},
                    a_headers,
                ),
            )
            await b_reader

    streamed, whole, by_prompt = attempts
    a_ids: set[str] = set()
    for headers, events in (streamed, by_prompt):
        assert headers["x-session-id"] != b_session_id
        assert headers["x-request-id"] != b_request_id
        a_ids.add(headers["x-request-id"])
        assert events and all(e["id"].endswith(headers["x-request-id"]) for e in events)
    assert whole.status_code == 200
    assert whole.headers["x-session-id"] != b_session_id
    assert whole.json()["id"].endswith(whole.headers["x-request-id"])
    a_ids.add(whole.headers["x-request-id"])
    assert b_request_id not in a_ids
    # Nothing of B's reached A: no event of A's carries B's response ID.
    a_event_ids = {e["id"] for _, events in (streamed, by_prompt) for e in events}
    assert not any(b_request_id in event_id for event_id in a_event_ids)

    # B's stream is whole and B's alone: every event B's, ending with its usage.
    assert all(e["id"] == f"chatcmpl-{b_request_id}" for e in b_events)
    usage = b_events[-1]["usage"]
    assert b_events[-1]["choices"] == [] and usage["completion_tokens"] >= 1
    rows = await eventually(
        lambda: open_reader(settings).query(
            "SELECT tenant_id, status, completion_tokens FROM usage_events FINAL "
            "WHERE request_id = {r:String}",
            {"r": b_request_id},
        )
    )
    assert rows == [
        {"tenant_id": "br-bob", "status": "ok", "completion_tokens": usage["completion_tokens"]}
    ]


async def test_restarting_one_bridge_does_not_disturb_another(stack: Stack) -> None:
    first = start_bridge(stack)
    second = start_bridge(stack)
    headers = {"Authorization": f"Bearer {bridge_key('br-alice')}"}
    body = {"model": MODEL, "prompt": "survive", "max_tokens": 300, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            surviving = asyncio.create_task(
                read_stream(http, f"{second.url}/v1/completions", body, headers)
            )
            await asyncio.sleep(0.5)
            first.stop()  # SIGTERM: its reply topic goes away with it
            first = start_bridge(stack)
            again = await http.post(
                f"{first.url}/v1/completions",
                json={**body, "stream": False, "max_tokens": 4},
                headers=headers,
            )
            _, events = await surviving
        assert again.status_code == 200
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert first.process.poll() is None and second.process.poll() is None
    finally:
        first.stop()
        second.stop()
