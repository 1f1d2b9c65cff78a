"""The adapters a worker's engine holds, and their loads: each first load is timed,
logged, and counted for the heartbeat (there is no tracing yet: the log line and the
job's ``tokenbus_job_worker_adapter_loads`` / ``..._last_adapter_load_ms`` gauges are
where a first load shows).

# WorkItem.adapter --> ensure (load once, concurrent requests wait on the one load)
# engine.held_adapters --> the names the heartbeat reports
"""

from __future__ import annotations

import asyncio
import logging
import time

from workers.interface import AdapterRef, Engine

log = logging.getLogger(__name__)


class AdapterBook:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._names: dict[int, str] = {}
        self._held: set[int] = set()
        self._loading: dict[int, asyncio.Future[None]] = {}
        self.num_loads = 0
        self.last_load_ms: float | None = None

    async def ensure(self, adapter: AdapterRef, request_id: str = "") -> None:
        """Returns once the engine holds ``adapter``; loads it if it does not."""
        self._names[adapter.lora_int_id] = adapter.name
        if adapter.lora_int_id in self._held:
            return
        loading = self._loading.get(adapter.lora_int_id)
        if loading is not None:
            await asyncio.shield(loading)
            return
        done = asyncio.get_running_loop().create_future()
        self._loading[adapter.lora_int_id] = done
        started = time.monotonic()
        try:
            await self._engine.load_adapter(adapter)
            elapsed_ms = (time.monotonic() - started) * 1000
            self.num_loads += 1
            self.last_load_ms = elapsed_ms
            log.info(
                "loaded adapter %s (id %d) from %s in %.1f ms, for %s",
                adapter.name,
                adapter.lora_int_id,
                adapter.path,
                elapsed_ms,
                request_id,
            )
            self._held = await self._engine.held_adapters()
            self._held.add(adapter.lora_int_id)
            done.set_result(None)
        except BaseException as exc:
            done.set_exception(exc)
            done.exception()  # retrieved: waiters get it, nobody else must
            raise
        finally:
            del self._loading[adapter.lora_int_id]

    async def refresh(self) -> None:
        """Reads what the engine holds now (its cache evicts the least recently used)."""
        self._held = await self._engine.held_adapters()

    def held_names(self) -> list[str]:
        return sorted(self._names[i] for i in self._held if i in self._names)
