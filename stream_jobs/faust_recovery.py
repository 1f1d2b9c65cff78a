"""The job's stream partitions resume only once Faust has cleared the agents' queues.

# Recovery.on_recovery_completed: seek --> clear the agents' queues --> resume the streams

Faust 0.15.3 (``faust.tables.recovery.Recovery.on_recovery_completed``) resumes the
stream partitions (the requests, usage and cancels the agents read), then seeks them to
their committed offsets, then resumes ``app.flow_control``, which empties every agent's
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
"""

from __future__ import annotations

import asyncio
from typing import Any

from faust.tables.recovery import Recovery

from tokenbus.tansu.patch import Patch

_patch = Patch(Recovery, "on_recovery_completed")


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


def resume_streams_after_the_clear() -> None:
    """Installs the order above in Faust's recovery for this process (idempotent)."""
    if not _patch.on:
        _patch.put(on_recovery_completed)


def uninstall() -> None:
    """Faust's recovery as it ships again."""
    _patch.undo()
