"""A TCP proxy that holds every byte for ``delay_s`` each way: the network delay of the
chaos matrix, where the kernel has no ``netem`` (this machine's: ``tc qdisc add ...
netem`` answers "Specified qdisc kind is unknown", and there are no modules to load).

It listens inside a network namespace, on an address that is local there, and connects
from the host's namespace: a socket belongs to the namespace it was made in, so one
thread enters the namespace to make the listening socket and leaves. A worker started
in that namespace reaches the broker's advertised address only through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
import threading
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000


def listen_in(netns: str, host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` in the named network namespace."""
    made: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with (Path("/run/netns") / netns).open() as target:
                if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns}")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
            made.append(sock)
        except BaseException as exc:  # handed to the caller's thread
            made.append(exc)

    # The thread ends inside the namespace; the caller's threads never enter it.
    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


class DelayProxy:
    """Forwards each connection to ``upstream``; ``delay_s`` (settable at any time)
    is added to every chunk, both ways, in order."""

    def __init__(self, listening: socket.socket, upstream: tuple[str, int]) -> None:
        self.listening = listening
        self.upstream = upstream
        self.delay_s = 0.0
        self.num_connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, sock=self.listening)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except asyncio.CancelledError:
            # Cancelled as the loop ends: asyncio's server reads a cancelled handler's
            # exception and logs a traceback; a handler that returns logs nothing.
            writer.close()
            up_writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await reader.read(65536):
                    queue.put_nowait((time.monotonic() + self.delay_s, data))
            queue.put_nowait((0.0, b""))

        async def write() -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while True:
                    due, data = await queue.get()
                    if not data:
                        break
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(read(), write())
