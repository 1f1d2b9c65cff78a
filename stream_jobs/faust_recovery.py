"""Two races in which Faust drops records its consumer has already fetched, closed.

# Recovery.on_recovery_completed: seek --> clear the agents' queues --> resume the streams
# AIOKafkaConsumerThread.getmany: aiokafka drains the partitions Faust has active, none for none

Both are Faust's, not the broker's, so the job installs both for every broker
(``install``). In each, aiokafka's position moves past records that never reach an
agent; Faust's read offset stays at the committed one and its commits stop there, and
the requests waiting for a restarted job are never taken (the job logs "the job has
taken nothing of ... while behind it").

**Recovery's order.** Faust 0.15.3
(``faust.tables.recovery.Recovery.on_recovery_completed``) resumes the stream partitions
(the requests, usage and cancels the agents read), then seeks them to their committed
offsets, then resumes ``app.flow_control``, which empties every agent's
queue (``clear_on_resume``). Records the fetcher hands over while the seek runs (one
offset fetch per partition, a round trip each) reach the agents' queues and are emptied
from them. The consumer has moved past them and nothing reads them again: a restarted
job took 1, or 39, of the 100 requests waiting for it and then nothing, and Faust's
commits stop at the first one lost (its acked offsets have a gap). The slower the
broker answers, the longer the window, which is why full test runs on the bundled
broker met it and short ones rarely did; Apache Kafka narrows it, it does not close it
(faust-streaming issue 596).

Here the same steps run in an order that loses nothing: seek, clear, then resume the
stream partitions. Their records fetched meanwhile stay with the consumer (a paused
partition's are not handed over) and reach the agents after the clear. Installed by
the job for every broker, since the race is Faust's.

**The fetch's partitions.** Faust (0.15.3, ``Consumer._wait_next_records``) hands its
consumer thread its live set of active partitions, and aiokafka's
``Fetcher.fetched_records`` reads that set again each time a fetch answer wakes it, for
up to the ``getmany`` timeout (1 s). Faust pauses partitions in that set: all the
changelogs once the tables are recovered, while the stream partitions are still paused.
aiokafka drains *every* partition for an empty set, so a fetch that Faust began while
recovering the tables drains the request partitions, and Faust, finding them paused,
drops the records it got. Before the end-of-recovery seek that is harmless (the seek
goes back); once the seek has moved a partition (one offset lookup per partition, a
round trip each) it is a loss. It needs an answer for that partition to arrive after its
seek and within the second, so a broker slow to answer fetches of large partitions met
it in full test runs and short runs hardly ever did. Here the thread reads the same live
set through a view that is never empty: a partition is drained while Faust has it
active, as before, and none when Faust has none.
"""

from __future__ import annotations

import asyncio
from typing import Any

from faust.tables.recovery import Recovery
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

from tokenbus.tansu.patch import Patch

_patch = Patch(Recovery, "on_recovery_completed")
_getmany = Patch(AIOKafkaConsumerThread, "getmany")


async def on_recovery_completed(self: Any, generation_id: int = 0) -> None:
    """Faust's ``on_recovery_completed``, the stream partitions resumed last."""
    app = self.app
    consumer = app.consumer
    self.log.info("Restore complete!")
    await app.on_rebalance_complete.send()
    self._set_recovery_ended()
    callbacks = [
        asyncio.ensure_future(
            table.on_recovery_completed(
                self.actives_for_table[table], self.standbys_for_table[table]
            )
        )
        for table in self.tables.values()
    ]
    if callbacks:
        await asyncio.wait(callbacks)
    assignment = consumer.assignment()
    if app.consumer_generation_id != generation_id:
        self.log.warning(
            f"Recovery rebalancing again app id {app.consumer_generation_id} param {generation_id}"
        )
        return
    if assignment:
        self.log.info("Seek stream partitions to committed offsets.")
        await self._wait(consumer.perform_seek(), timeout=app.conf.broker_request_timeout)
    self.completed.set()
    app.flow_control.resume()  # empties the agents' queues: no stream record is in them
    consumer.resume_flow()
    consumer.resume_partitions({tp for tp in assignment if not self._is_changelog_tp(tp)})
    await app._fetcher.maybe_start()
    self.tables.on_actives_ready()
    if not app.assignor.assigned_standbys():
        self.tables.on_standbys_ready()
    app.on_rebalance_end()
    self.log.info("Worker ready")


class ActivePartitions:
    """Faust's live set of active partitions as aiokafka's fetcher reads it: membership
    as the set is now, and never empty, for aiokafka drains every partition for an
    empty set. (Its only uses there: ``if partitions and tp not in partitions``.)"""

    __slots__ = ("_live",)

    def __init__(self, live: Any) -> None:
        self._live = live

    def __bool__(self) -> bool:
        return True

    def __contains__(self, tp: object) -> bool:
        return tp in self._live


async def getmany(self: Any, active_partitions: Any, timeout: float) -> Any:  # noqa: ASYNC109 (Faust's signature)
    """Faust's ``getmany`` of its consumer thread, draining only partitions active in
    Faust: none when it has none (not all of them)."""
    if active_partitions is None:  # a client-only app: every partition, as Faust asks
        return await _getmany.original()(self, None, timeout)
    return await _getmany.original()(self, ActivePartitions(active_partitions), timeout)


def install() -> None:
    """Installs both fixes in Faust for this process (idempotent)."""
    if not _patch.on:
        _patch.put(on_recovery_completed)
    if not _getmany.on:
        _getmany.put(getmany)


def uninstall() -> None:
    """Faust as it ships again."""
    _patch.undo()
    _getmany.undo()
