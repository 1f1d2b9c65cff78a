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

from producers.inbox import Inbox
from tokenbus.chunks import Chunk

log = logging.getLogger(__name__)


class ChunkFeed:
    def __init__(self, chunks: AsyncIterator[Chunk], tenant_id: str) -> None:
        self._tenant_id = tenant_id
        self._inbox: Inbox[Chunk | Exception] = Inbox()
        self._task = asyncio.create_task(self._drain(chunks))

    async def get(self, timeout_s: float | None) -> Chunk | None:
        """The next chunk; None if none came within ``timeout_s``. Re-raises the stream's
        error (``TokenbusTimeout`` after ``client_timeout_s`` of silence)."""
        items = self._inbox.items
        if not items and not await self._inbox.wait(timeout_s):
            return None
        item = items.popleft()
        if isinstance(item, Exception):
            raise item
        return item

    def ready(self) -> Chunk | None:
        """The next chunk if one is already here, without waiting; None otherwise (and
        when the next item is the stream's error, which ``get`` then raises)."""
        items = self._inbox.items
        if items and not isinstance(items[0], Exception):
            item = items.popleft()
            assert not isinstance(item, Exception)
            return item
        return None

    def close(self) -> None:
        """Stops reading; the client forgets the request once the drain task unwinds."""
        self._task.cancel()
        self._inbox.close()

    async def _drain(self, chunks: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in chunks:
                if chunk.tenant_id != self._tenant_id:
                    log.warning(
                        "dropped a chunk of tenant %s on a stream of another", chunk.tenant_id
                    )
                    continue
                self._inbox.put(chunk)
        except Exception as exc:
            self._inbox.put(exc)
