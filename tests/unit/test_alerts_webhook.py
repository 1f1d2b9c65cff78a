from __future__ import annotations

import httpx

from billing.alerts.webhook import WebhookSender, sign, verify
from tokenbus.retry import Backoff


async def test_an_alert_is_signed_and_retried_with_backoff_until_taken() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200 if len(seen) == 3 else 503)

    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    sender = WebhookSender(
        "http://receiver/hook",
        "s3cret",
        backoff=Backoff(initial_s=0.5, max_s=30.0),
        client=httpx.AsyncClient(transport=httpx.MockTransport(answer)),
        sleep=sleep,
    )
    assert await sender.deliver("a|b|50", b'{"threshold":50}') == 3
    assert waits == [0.5, 1.0]
    last = seen[-1]
    assert last.headers["X-Tokenbus-Alert-Id"] == "a|b|50"
    timestamp = last.headers["X-Tokenbus-Timestamp"]
    assert verify("s3cret", timestamp, last.content, last.headers["X-Tokenbus-Signature"])
    assert not verify("other", timestamp, last.content, last.headers["X-Tokenbus-Signature"])
    assert sign("s3cret", timestamp, last.content).startswith("sha256=")
    await sender.close()
