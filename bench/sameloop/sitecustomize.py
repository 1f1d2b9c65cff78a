"""Faust's Kafka consumer on the app's own event loop instead of a thread of its own: a
diagnostic, to measure what the thread costs. Put this directory on ``PYTHONPATH`` with
``SAMELOOP=1`` and every Faust app started with it (the job, ``bench.faust_floor``'s
admitters) runs its consumer in the main thread:

    SAMELOOP=1 PYTHONPATH=bench/sameloop .venvs/stream/bin/python -m bench.faust_floor

Faust 0.15.3 runs aiokafka's consumer in a ``ServiceThread`` with a loop of its own, and
every call from the app's loop to it (``getmany`` for each fetch, commits, seeks) goes
through the thread's method queue and back. Here the consumer thread's service is
started on the app's loop, its calls are awaited in place, and nothing else changes.
It is not how the job runs: its stop path is not the thread's (a ``ServiceThread`` that
shares the app's loop must not cancel the loop's tasks when it stops, which the thread's
does), and only the bursts of ``bench.faust_floor`` and ``bench.admission`` have run on
it. ``bench.admission``'s ``job_cpu_s_by_thread`` shows whether it took: the job's other
threads spend nothing.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import Any

# The worker's environment has no Faust: nothing to patch there.
if os.environ.get("SAMELOOP") == "1" and importlib.util.find_spec("faust") is not None:
    from faust.transport.drivers import aiokafka as driver
    from mode.utils.futures import maybe_async

    class SameLoopConsumerThread(driver.AIOKafkaConsumerThread):
        """The consumer's service, on the loop that made it."""

        async def start(self) -> None:
            self._thread_started.set()
            await self._default_start()
            await self.on_thread_started()

        async def stop(self) -> None:
            if self._started.is_set():
                await self._shutdown_thread()

        async def _gather_remaining_tasks(self) -> None:
            return None  # the loop's tasks are the app's, not this service's

        async def call_thread(
            self, fun: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
        ) -> Any:
            return await maybe_async(fun(*args, **kwargs))

        async def cast_thread(
            self, fun: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
        ) -> None:
            self.add_future(maybe_async(fun(*args, **kwargs)))

        def _stopped_set(self) -> None:
            self._stopped.set()

        def set_shutdown(self) -> None:
            self._shutdown.set()

    def _new_consumer_thread(self: Any) -> SameLoopConsumerThread:
        return SameLoopConsumerThread(
            self, loop=self.loop, thread_loop=self.loop, beacon=self.beacon
        )

    driver.Consumer._new_consumer_thread = _new_consumer_thread  # type: ignore[method-assign]
