"""stream_jobs.faust_recovery: a record the fetcher hands over while the stream
partitions are seeked at the end of recovery reaches its agent; with Faust's own order it
is emptied from the agent's queue by the flow-control resume, and never read again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from mode.utils.queues import FlowControlEvent, ThrowableQueue

from stream_jobs import faust_recovery

REQUESTS = ("tokenbus.requests.p1", 3)
CHANGELOG = ("tokenbus-dispatch-request-ledger-changelog", 3)


class Consumer:
    """Faust's consumer as recovery drives it, with a fetcher that hands the records it
    holds to the agent's queue for partitions the stream takes (Faust's active ones)."""

    def __init__(self, queue: ThrowableQueue[Any]) -> None:
        self.queue = queue
        self.active: set[tuple[str, int]] = set()
        self.held = {REQUESTS: ["request at the committed offset"]}

    def assignment(self) -> set[tuple[str, int]]:
        return {REQUESTS, CHANGELOG}

    def resume_partitions(self, tps: set[tuple[str, int]]) -> None:
        self.active |= set(tps)

    def resume_flow(self) -> None:
        pass

    def hand_over(self) -> None:
        for tp in [tp for tp in self.held if tp in self.active]:
            for record in self.held.pop(tp):
                self.queue.put_nowait(record)

    async def perform_seek(self) -> None:
        # One committed-offset round trip per partition: the fetcher runs meanwhile.
        await asyncio.sleep(0)
        self.hand_over()


def recovery(consumer: Consumer, flow_control: FlowControlEvent) -> Any:
    async def wait(coro: Awaitable[None], **_: Any) -> None:
        await coro

    async def nothing(*args: Any) -> None:
        pass

    app = SimpleNamespace(
        consumer=consumer,
        flow_control=flow_control,
        on_rebalance_complete=SimpleNamespace(send=nothing),
        consumer_generation_id=0,
        conf=SimpleNamespace(broker_request_timeout=90.0),
        _fetcher=SimpleNamespace(maybe_start=nothing),
        assignor=SimpleNamespace(assigned_standbys=set),
        on_rebalance_end=lambda: None,
    )
    return SimpleNamespace(
        app=app,
        log=SimpleNamespace(info=print, warning=print, dev=print),
        tables=SimpleNamespace(
            values=list, on_actives_ready=lambda: None, on_standbys_ready=lambda: None
        ),
        actives_for_table={},
        standbys_for_table={},
        completed=asyncio.Event(),
        _set_recovery_ended=lambda: None,
        _wait=wait,
        _is_changelog_tp=lambda tp: tp == CHANGELOG,
    )


async def delivered(completed: Callable[..., Awaitable[None]]) -> list[Any]:
    flow_control = FlowControlEvent()
    flow_control.resume()  # resumed for the changelogs when recovery began
    queue: ThrowableQueue[Any] = ThrowableQueue(
        maxsize=100, flow_control=flow_control, clear_on_resume=True
    )
    consumer = Consumer(queue)
    await completed(recovery(consumer, flow_control), 0)
    consumer.hand_over()  # the fetcher goes on
    return list(queue._queue)  # type: ignore[attr-defined]


async def test_a_record_fetched_during_the_seek_reaches_the_agent() -> None:
    assert await delivered(faust_recovery.on_recovery_completed) == [
        "request at the committed offset"
    ]


async def test_faust_s_own_order_empties_it_from_the_agent_s_queue() -> None:
    shipped = faust_recovery._patch.original()
    assert await delivered(shipped) == []  # lost: the consumer has moved past it
