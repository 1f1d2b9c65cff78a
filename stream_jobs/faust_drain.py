"""Faust's consumer hands each fetched record to its agents without four tasks a record.

# Consumer._drain_messages: for each record --> wait_first(on_message(record), suspend_flow)
# here: on_message run at once --> done without waiting: no task at all
#                                --> it waits (flow stopped, a queue full): wait_first as before

Faust 0.15.3 (``faust.transport.consumer.Consumer._drain_messages``) delivers every
record through ``Service.wait_first(callback(message), self.suspend_flow.wait())``, so
that a rebalance suspending the flow interrupts a delivery blocked on a full agent
queue. ``wait_first`` makes a task of each of the two, and two more for the service's
stopped and crashed events, waits on all four with ``asyncio.wait``, and cancels the
three that lost, for a delivery that, nearly always, never waits at all (the conductor's
``on_message`` takes its lock, finds the flow on and the producer's buffer low, decodes,
and puts the event on the agent's queue without blocking). Faust's floor for forwarding
a request (``bench.faust_floor``) fell from 96 to 52 µs of CPU with this (BENCHMARKS.md).

``wait_first`` here first runs a coroutine it is given up to its first wait, in the
caller's task (nothing Faust's delivery does asks which task it runs in), as the task
``wait_first`` would make of it would run it. A coroutine
that ends there has its result (or its exception) at once, and the others it was given
are closed unawaited: none of them could have ended first, since none had run. One that
waits goes on in ``wait_first`` as Faust ships it, from where it stopped, so a suspended
flow, a stop or a crash interrupts it exactly as before. Anything else (events, a
timeout, a stopped service) goes to Faust's own. Installed for every broker.
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine, Generator
from typing import Any

from faust.transport.consumer import Consumer
from mode.services import WaitResults

from tokenbus.tansu.patch import Patch

_patch = Patch(Consumer, "wait_first")


class Resumed:
    """A coroutine already run up to its first wait, as an awaitable: awaiting it waits
    for what the coroutine was waiting for, then goes on driving it, as its task would
    have (every value and exception passed through)."""

    __slots__ = ("_coro", "_waiting_for")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_for: Any) -> None:
        self._coro = coro
        self._waiting_for = waiting_for

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._waiting_for
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown in by the task: a cancel, say
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def wait_first(self: Any, *coros: Any, timeout: Any = None) -> Any:  # noqa: ASYNC109 (mode's signature)
    """``Service.wait_first`` with its first coroutine run at once (see the module)."""
    original = _patch.original()
    first = coros[0] if coros else None
    if (
        timeout is not None
        or not inspect.iscoroutine(first)
        or self._stopped.is_set()
        or self._crashed.is_set()
    ):
        return await original(self, *coros, timeout=timeout)
    try:
        waiting_for = first.send(None)
    except StopIteration as stop:
        _close(coros[1:])
        return WaitResults([first], [stop.value], False)
    except BaseException:
        _close(coros[1:])
        raise
    return await original(self, Resumed(first, waiting_for), *coros[1:], timeout=timeout)


def _close(coros: tuple[Any, ...]) -> None:
    for coro in coros:
        if inspect.iscoroutine(coro):
            coro.close()


def install() -> None:
    """Installs the fast path in Faust's consumer for this process (idempotent)."""
    if not _patch.on:
        _patch.put(wait_first)


def uninstall() -> None:
    """Faust as it ships again."""
    _patch.undo()
