"""Which topics a producer asks the broker about (aiokafka's client, patched per instance
by ``track_sent_topics``).

# send(topic) --> tracked from its first send on (before its batch is queued)
# a forgettable topic (a reply topic) sent nothing for a round --> no longer tracked
# metadata request --> asks for the tracked topics only (all of them while none is)

aiokafka's client asks for the metadata of every topic while it tracks none, and only
for the topics it tracks once it tracks one. Left alone, a producer tracks a topic only
when it sends to one its metadata lacks: a topic it learned of from an all-topics answer
is sent to without being tracked. So the first new topic (a reply topic, a topic
created since the start) made the next answer leave every such topic out, and a batch
already queued for one of them found no leader: it waited, asking again for the same
tracked topics, until it expired (``request_timeout_ms``), and every flush waited with
it. In the Faust job that was a changelog record of the quota window: Faust's commit
flushes the producer first, so commits stopped for 30 s, and a SIGTERM waited in
``Consumer.wait_empty`` behind that commit.

So a producer tracks every topic it sends to, from the send on: a queued batch's topic
is always in the answers. It does not track what it never sends to, and it lets go of a
reply topic it has sent nothing to for a round (``forget_after_s``, so between one and
two rounds after its last send) once no batch for it is queued. That matters because a
metadata request names the topics it asks about, and a broker that creates topics on
demand (the bundled one; Apache Kafka with ``auto.create.topics.enable``) makes a
deleted one again, empty: a client deletes its reply topics when it closes and, on the
bundled broker, each one it rolls off (``producers.reply_topics``). A producer that
tracked every topic it ever knew made each of them again at every metadata refresh, for
good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable
from typing import Any


class SentTopics:
    """Which tracked topics a producer may stop asking about. Pure: the caller runs the
    rounds.

    A round is ``forget``: the ``forgettable`` topics tracked that nothing was sent to
    since the round before, and that have no batch queued, are let go."""

    def __init__(self, forgettable: Callable[[str], bool]) -> None:
        self._forgettable = forgettable
        self.recent: set[str] = set()
        """Topics sent to since the last round (filled on the send path)."""

    def forget(self, tracked: Collection[str], queued: Iterable[str]) -> set[str]:
        """The topics of ``tracked`` to let go of now; starts the next round."""
        keep = self.recent.union(queued)
        self.recent = set()
        return {t for t in tracked if t not in keep and self._forgettable(t)}

    def any_forgettable(self, tracked: Collection[str]) -> bool:
        """Whether another round is worth running."""
        return any(self._forgettable(t) for t in tracked)


def track_sent_topics(
    producer: Any, *, forgettable: Callable[[str], bool], forget_after_s: float
) -> SentTopics:
    """Makes ``producer`` (an ``aiokafka.AIOKafkaProducer``) track each topic it sends to
    from its first send, and let go of a ``forgettable`` one it sent nothing to for a
    round of ``forget_after_s``. Rounds run on the running loop while a forgettable topic
    is tracked."""
    client = producer.client
    cluster = client.cluster
    partitions_for_topic = cluster.partitions_for_topic
    topics = SentTopics(forgettable)
    rounds: list[asyncio.TimerHandle] = []

    def queued() -> Iterable[str]:
        batches = producer._message_accumulator._batches
        return {tp.topic for tp, queue in batches.items() if queue}

    def run_round() -> None:
        rounds.clear()
        if producer._closed:
            return
        tracked = client._topics
        tracked.difference_update(topics.forget(tracked, queued()))
        if topics.any_forgettable(tracked):
            schedule()

    def schedule() -> None:
        loop = asyncio.get_running_loop()
        rounds.append(loop.call_later(forget_after_s, run_round))

    def partitions_sending_to(topic: str) -> Any:
        # aiokafka's send path asks this before it queues a batch for ``topic``.
        if topic not in client._topics:
            client.add_topic(topic)  # every answer from here on keeps it
            if not rounds and forgettable(topic):
                schedule()
        topics.recent.add(topic)
        return partitions_for_topic(topic)

    cluster.partitions_for_topic = partitions_sending_to
    return topics
