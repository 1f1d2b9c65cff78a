"""One budget alert --> one signed POST, retried with backoff until the receiver takes it.

The body is the alert's JSON as it sits on the topic. ``X-Tokenbus-Signature`` is
``sha256=`` and the hex HMAC-SHA256 of ``<X-Tokenbus-Timestamp>.<body>`` under
``Settings.budget_webhook_secret``; ``X-Tokenbus-Alert-Id`` repeats the alert's id, so
a receiver drops the rare repeat (see ``billing.alerts.__main__`` for when one happens).
A 2xx answer is taken; anything else, or no answer, is retried after a doubling wait.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from tokenbus.retry import Backoff

log = logging.getLogger(__name__)


def sign(secret: str, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + digest.hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """What a receiver checks (and the tests do)."""
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


class WebhookSender:
    def __init__(
        self,
        url: str,
        secret: str,
        *,
        backoff: Backoff | None = None,
        client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._url = url
        self._secret = secret
        self._backoff = backoff or Backoff()
        self._client = client or httpx.AsyncClient(timeout=10.0)
        self._sleep = sleep

    async def deliver(self, alert_id: str, body: bytes) -> int:
        """Posts until a 2xx; returns the number of attempts it took."""
        num_failures = 0
        while True:
            timestamp = str(int(time.time()))
            headers = {
                "Content-Type": "application/json",
                "X-Tokenbus-Alert-Id": alert_id,
                "X-Tokenbus-Timestamp": timestamp,
                "X-Tokenbus-Signature": sign(self._secret, timestamp, body),
            }
            try:
                response = await self._client.post(self._url, content=body, headers=headers)
                if 200 <= response.status_code < 300:
                    return num_failures + 1
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            num_failures += 1
            wait = self._backoff.delay_s(num_failures)
            log.warning("alert %s: %s; again in %.1f s", alert_id, problem, wait)
            await self._sleep(wait)

    async def close(self) -> None:
        await self._client.aclose()
