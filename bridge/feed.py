"""One request's Chunks, readable with a timeout that never breaks the stream.

``TokenbusClient.stream()`` is an async generator, and cancelling a read from one ends
it. A drain task reads the generator into a queue instead, so the bridge can wait for
the first chunk (or the next heartbeat) with a timeout and simply read again.
Chunks of another tenant are dropped here: a request's stream is its tenant's only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from tokenbus.chunks import Chunk

log = logging.getLogger(__name__)


class ChunkFeed:
    def __init__(self, chunks: AsyncIterator[Chunk], tenant_id: str) -> None:
        self._tenant_id = tenant_id
        self._queue: asyncio.Queue[Chunk | Exception] = asyncio.Queue()
        self._task = asyncio.create_task(self._drain(chunks))

    async def get(self, timeout_s: float | None) -> Chunk | None:
        """The next chunk; None if none came within ``timeout_s``. Re-raises the stream's
        error (``TokenbusTimeout`` after ``client_timeout_s`` of silence)."""
        if not self._queue.empty():  # no timer when the chunk is already here
            item = self._queue.get_nowait()
        else:
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout_s)
            except TimeoutError:
                return None
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        """Stops reading; the client forgets the request once the drain task unwinds."""
        self._task.cancel()

    async def _drain(self, chunks: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in chunks:
                if chunk.tenant_id != self._tenant_id:
                    log.warning(
                        "dropped a chunk of tenant %s on a stream of another", chunk.tenant_id
                    )
                    continue
                self._queue.put_nowait(chunk)
        except Exception as exc:
            self._queue.put_nowait(exc)
