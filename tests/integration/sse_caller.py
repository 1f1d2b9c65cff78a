"""A streaming caller that times its first event by the kernel's clock.

A caller's TTFT, read when its own process gets to the bytes, holds that process's
wake-up: on a loaded machine a runnable process can wait several ms for a core after
its socket has the bytes, and no span of the service can see that wait. The kernel
stamps each segment it receives (``SO_TIMESTAMPNS``); this caller reads the stamp of
the segment that completes the first ``data:`` line, so its TTFT ends where the bytes
reached the caller's host, as a packet capture there would time it. It speaks
HTTP/1.1 on one kept-alive connection (as a client's second request finds it open)
and stamps ``X-Request-Start`` just before it writes the request.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's number
_TIMESPEC = struct.Struct("qq")


@dataclass(frozen=True)
class FirstEvent:
    request_id: str
    status: int
    ttft_ms: float
    """From the stamp to the kernel's receipt of the first event's last byte."""
    read_ms: float
    """From the stamp to this process reading it (the kernel's receipt, plus wake-up)."""
    stamped: bool
    """The kernel stamped the segment (else ``ttft_ms`` is ``read_ms``)."""


class SseCaller:
    """One kept-alive HTTP/1.1 connection to ``host:port``; blocking."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self._host = f"{host}:{port}"
        self._pending = b""
        self._segment_ns: int | None = None
        """The kernel's stamp of the last segment read (None if it gave none)."""
        self._read_ns = 0
        """When this process read it."""

    def close(self) -> None:
        self._sock.close()

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> FirstEvent:
        """Sends the request, reads the whole response (chunked, as the bridge streams),
        and times its first ``data:`` line."""
        raw = json.dumps(body).encode()
        stamp_ns = time.time_ns()
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {self._host}",
            "Content-Type: application/json",
            f"Content-Length: {len(raw)}",
            f"X-Request-Start: t={stamp_ns // 1000}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        self._sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + raw)
        head, first = self._read_response()
        status_line, *fields = head.split("\r\n")
        named = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
        assert first is not None, head
        segment_ns, read_ns = first
        return FirstEvent(
            request_id=named["x-request-id"],
            status=int(status_line.split()[1]),
            ttft_ms=((segment_ns or read_ns) - stamp_ns) / 1e6,
            read_ms=(read_ns - stamp_ns) / 1e6,
            stamped=segment_ns is not None,
        )

    def _read_response(self) -> tuple[str, tuple[int | None, int] | None]:
        """The response's head, and the kernel's stamp and the read time of the segment
        that completed its first ``data:`` line (None if it had none). The body is
        chunked; its last chunk ends the response."""
        buffer = self._pending
        head: str | None = None
        body = b""
        first: tuple[int | None, int] | None = None
        while True:
            if head is None and b"\r\n\r\n" in buffer:
                raw_head, _, buffer = buffer.partition(b"\r\n\r\n")
                head = raw_head.decode("latin-1")
            if head is not None:
                body += buffer
                buffer = b""
                at = body.find(b"\ndata:")
                if first is None and at >= 0 and body.find(b"\n", at + 1) >= 0:
                    first = (self._segment_ns, self._read_ns)
                if body.endswith(b"\r\n0\r\n\r\n"):
                    self._pending = b""
                    return head, first
            data, ancillary, _, _ = self._sock.recvmsg(65536, socket.CMSG_SPACE(16))
            self._read_ns = time.time_ns()
            if not data:
                raise ConnectionError("the bridge closed the connection")
            self._segment_ns = None
            for level, kind, value in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    seconds, nanoseconds = _TIMESPEC.unpack(value[: _TIMESPEC.size])
                    self._segment_ns = seconds * 10**9 + nanoseconds
            buffer += data
