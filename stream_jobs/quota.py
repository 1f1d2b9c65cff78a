"""Per-tenant tokens-per-minute, reserved up front and settled on the real count.

A pure policy: the caller passes the clock. This is the spine's simple fixed window;
the sliding-window TPM/RPM policy with changelog-backed state replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True)
class Admission:
    admitted: bool
    retry_after_s: float = 0.0
    used: int = 0
    limit: int = 0


class MinuteTokenQuota:
    """One fixed 60 s window per tenant; the window starts at the tenant's first request."""

    def __init__(self) -> None:
        self._windows: dict[str, tuple[float, int]] = {}  # tenant -> (start, tokens used)

    def reserve_tokens(self, tenant_id: str, tokens: int, limit: int, now: float) -> Admission:
        start, used = self._windows.get(tenant_id, (now, 0))
        if now - start >= WINDOW_S:
            start, used = now, 0
        if used + tokens > limit:
            return Admission(False, retry_after_s=start + WINDOW_S - now, used=used, limit=limit)
        self._windows[tenant_id] = (start, used + tokens)
        return Admission(True, used=used + tokens, limit=limit)

    def reconcile_usage(self, tenant_id: str, reserved: int, actual: int, now: float) -> None:
        """Refunds what a request reserved but did not use (or charges its overrun)."""
        start, used = self._windows.get(tenant_id, (now, 0))
        if now - start < WINDOW_S:
            self._windows[tenant_id] = (start, max(0, used - reserved + actual))


def estimate_prompt_tokens(text: str) -> int:
    """Byte-level BPE never needs more tokens than UTF-8 bytes: a safe upper bound."""
    return len(text.encode("utf-8"))
