"""Faust's pauses of its tables' changelog partitions reach aiokafka's fetcher.

# Faust pauses a changelog partition --> aiokafka pauses it too (in the consumer's thread)
# Faust resumes any partition        --> aiokafka resumes it (if it paused it)

Faust (0.15.3) pauses a partition in its own books only (``Consumer.pause_partitions``:
out of the set of active partitions it hands its consumer thread), not in aiokafka's.
Its tables' changelog partitions are paused so, once recovered, for as long as the
instance holds them: an active table writes its changelog and never reads it. aiokafka's
fetcher still asks the broker for every assigned partition it has not paused, so each
fetch of the job carried the 16 changelog partitions of its four tables (37 partitions
in all, 21 read), and a changelog record fetched so was kept undrained in the fetcher,
holding up the job's fetches to that broker for aiokafka's prefetch backoff (100 ms).
At concurrency 64 on the bundled broker that cost the job 11 to 27% and the broker 16
to 36% of their CPU per token; idle, it made no difference (bench/JOURNAL.md, "What changed
on 2026-12-05 (midday)").

Here Faust's pause of a changelog partition pauses it in aiokafka as well, and any
resume of Faust's resumes it there: recovery (which resumes the changelogs before it
reads them) and standbys (resumed to be read) read as before, and a rebalance starts
from a fresh aiokafka assignment, nothing paused. The calls run on the consumer
thread's loop, in the order Faust made them; a pause runs only if the partition is
still paused in Faust's books when its turn comes, so a resume made meanwhile wins.
Installed by the job for every broker: the cost is Faust's, on Apache Kafka too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiokafka import TopicPartition
from faust.transport.consumer import Consumer

from tokenbus.tansu.patch import Patch

_pause = Patch(Consumer, "pause_partitions")
_resume = Patch(Consumer, "resume_partitions")


def _fetcher_side(consumer: Any) -> tuple[Any, Any] | None:
    """aiokafka's consumer and the loop of the thread it runs in, once started."""
    thread = getattr(consumer, "_thread", None)
    client = getattr(thread, "_consumer", None)
    if thread is None or client is None:
        return None
    return client, thread.thread_loop


def pause_partitions(self: Any, tps: Iterable[Any]) -> None:
    """Faust's ``pause_partitions``; its changelog partitions paused in aiokafka too."""
    tps = set(tps)
    _pause.original()(self, tps)
    changelogs = {tp for tp in tps if self._is_changelog_tp(tp)}
    side = _fetcher_side(self)
    if changelogs and side is not None:
        client, loop = side
        loop.call_soon_threadsafe(_pause_in_fetcher, self, client, changelogs)


def resume_partitions(self: Any, tps: Iterable[Any]) -> None:
    """Faust's ``resume_partitions``; each one resumed in aiokafka too."""
    tps = set(tps)
    _resume.original()(self, tps)
    side = _fetcher_side(self)
    if tps and side is not None:
        client, loop = side
        loop.call_soon_threadsafe(_resume_in_fetcher, client, tps)


def _pause_in_fetcher(consumer: Any, client: Any, tps: set[Any]) -> None:
    """On the consumer's thread: those of ``tps`` still assigned and still paused in
    Faust's books (a resume since wins)."""
    assigned = client.assignment()
    still = [
        TopicPartition(tp.topic, tp.partition)
        for tp in tps
        if tp in assigned and tp in consumer._paused_partitions
    ]
    if still:
        client.pause(*still)


def _resume_in_fetcher(client: Any, tps: set[Any]) -> None:
    """On the consumer's thread: those of ``tps`` assigned and paused in aiokafka."""
    paused = client.paused()
    again = [TopicPartition(tp.topic, tp.partition) for tp in tps if tp in paused]
    if again:
        client.resume(*again)


def install() -> None:
    """Installs both for this process (idempotent)."""
    if not _pause.on:
        _pause.put(pause_partitions)
    if not _resume.on:
        _resume.put(resume_partitions)


def uninstall() -> None:
    """Faust as it ships again."""
    _pause.undo()
    _resume.undo()
