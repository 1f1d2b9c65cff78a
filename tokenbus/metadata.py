"""Which topics a producer asks the broker about (aiokafka's client, patched per instance
by ``ProducerTopics``).

# send(topic) --> tracked from its first send on (before its batch is queued)
# a forgettable topic (a reply topic) sent nothing for a round, or let go by its sender
#   (a worker, once no request of its answers there) --> no longer tracked
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
two rounds after its last send), or at once when its sender says it is done with it
(``ProducerTopics.let_go``), once no batch for it is queued. That matters because a
metadata request names the topics it asks about, and a broker that creates topics on
demand (the bundled one; Apache Kafka with ``auto.create.topics.enable``) makes a
deleted one again, empty: a client deletes its reply topics when it closes and, on the
bundled broker, each one it rolls off (``producers.reply_topics``). A producer that
tracked every topic it ever knew made each of them again at every metadata refresh, for
good.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaError


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


class ProducerTopics:
    """The topics ``producer`` (an ``aiokafka.AIOKafkaProducer``) asks the broker about:
    each one it sends to, from its first send (aiokafka's send path asks the cluster for
    the topic's partitions before it queues a batch), until it lets a ``forgettable``
    one go: after a round of ``forget_after_s`` with nothing sent to it, or at once when
    its sender says it has nothing more for it (``let_go``). Rounds run on the running
    loop while a forgettable topic is tracked, and stop when the producer is closed."""

    def __init__(
        self, producer: Any, *, forgettable: Callable[[str], bool], forget_after_s: float
    ) -> None:
        self._producer = producer
        self._client = producer.client
        self._forgettable = forgettable
        self._forget_after_s = forget_after_s
        self._sent = SentTopics(forgettable)
        self._round: asyncio.TimerHandle | None = None
        cluster = self._client.cluster
        self._partitions_for_topic = cluster.partitions_for_topic
        cluster.partitions_for_topic = self._partitions_sending_to

    def let_go(self, topic: str) -> None:
        """Stops asking about ``topic`` now, unless a batch for it is still queued (the
        rounds let it go then). Sending to it again tracks it again."""
        if topic not in self._queued():
            self._client._topics.discard(topic)

    def _partitions_sending_to(self, topic: str) -> Any:
        tracked = self._client._topics
        if topic not in tracked:
            self._client.add_topic(topic)  # every answer from here on keeps it
            if self._round is None and self._forgettable(topic):
                self._schedule()
        self._sent.recent.add(topic)
        return self._partitions_for_topic(topic)

    def _queued(self) -> set[str]:
        batches = self._producer._message_accumulator._batches
        return {tp.topic for tp, queue in batches.items() if queue}

    def _run_round(self) -> None:
        self._round = None
        if self._producer._closed:
            return
        tracked = self._client._topics
        tracked.difference_update(self._sent.forget(tracked, self._queued()))
        if self._sent.any_forgettable(tracked):
            self._schedule()

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        self._round = loop.call_later(self._forget_after_s, self._run_round)


class ExistingTopics:
    """Whether a topic exists, found out without making it: from the metadata a client
    holds, else from an answer about every topic (a metadata request that names no topic
    makes none), asked at most once per ``refresh_s`` (so a flood of names costs the
    broker ten such answers a second at most, by default, and a lookup waits that long
    at most, plus the answer), lookups meanwhile sharing it.

    A producer's send to a topic it holds no metadata of names the topic to the broker,
    and a broker that makes topics on demand (Kafka's default) makes it; one that does
    not keeps the send waiting for it. A service that sends to a topic an outsider named
    asks here first: the job, before it answers a record nobody proved, and before it
    admits a tenant's request (whose worker would send its tokens there)."""

    def __init__(
        self,
        client: Callable[[], Any],
        *,
        refresh_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``client``: the ``aiokafka`` client to ask with (called on each look, since
        a producer may make its client late)."""
        self._client = client
        self._refresh_s = refresh_s
        self._clock = clock
        self._every: frozenset[str] = frozenset()
        self._asked_at = -float("inf")
        self._asking: asyncio.Future[tuple[float, frozenset[str] | None]] | None = None

    async def __call__(self, topic: str, *, assume_on_failure: bool = False) -> bool:
        """Whether ``topic`` exists: in the client's metadata, in the last answer, or
        else in an answer asked after this lookup began (waiting for the next one when
        one was asked lately), so a topic a producer made a moment before it sent the
        record that names it counts. ``assume_on_failure``: what to take when that
        answer fails (a tenant's request is not refused for the broker's trouble; a
        producer nobody identified is not answered on a topic nobody saw)."""
        client = self._client()
        # ClusterMetadata's own lookup: a producer's is patched to start tracking the
        # topic (``ProducerTopics``), which would name it to the broker.
        if ClusterMetadata.partitions_for_topic(client.cluster, topic) is not None:
            return True
        if topic in self._every:
            return True
        began = self._clock()
        while True:
            if self._asking is None:
                wait_s = self._asked_at + self._refresh_s - self._clock()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                    continue
                self._asked_at = self._clock()
                self._asking = asyncio.ensure_future(self._ask(client))
            asking = self._asking
            try:
                sent_at, every = await asyncio.shield(asking)
            finally:
                if self._asking is asking and asking.done():
                    self._asking = None
            if every is None:
                return assume_on_failure
            self._every = every
            if topic in every:
                return True
            if sent_at >= began:
                return False

    async def _ask(self, client: Any) -> tuple[float, frozenset[str] | None]:
        """When the question went out (lookups that began before then, in the same loop
        turn say, take its answer as theirs), and every topic's name, or None when the
        broker did not answer."""
        sent_at = self._clock()
        try:
            metadata = await client.fetch_all_metadata()
        except KafkaError:
            return sent_at, None
        return sent_at, frozenset(metadata.topics())
