"""A producer asks the broker about the topics it sends to, from the first send on, and
lets go of a reply topic it no longer sends to (aiokafka's client asks only for the
tracked topics once it tracks one, and a broker that makes topics on demand makes a
deleted one again when asked about it)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaConnectionError
from aiokafka.protocol.metadata import MetadataResponse_v0
from aiokafka.structs import TopicPartition

from tokenbus.metadata import ExistingTopics, ProducerTopics, SentTopics

ROUND_S = 0.05


def answer(*topics: str) -> Any:
    """A metadata answer naming broker 1 as the leader of partition 0 of each topic."""
    return MetadataResponse_v0(
        [(1, "127.0.0.1", 9092)], [(0, topic, [(0, 0, 1, [1], [1])]) for topic in topics]
    )


def is_reply(topic: str) -> bool:
    return topic.startswith("replies.")


class Client:
    """What ``ProducerTopics`` uses of aiokafka's client, with its own ``add_topic``:
    the broker answers for the tracked topics only (all of them while none is tracked),
    and makes a topic it is asked about, as the bundled broker does."""

    def __init__(self, *on_broker: str) -> None:
        self.on_broker = set(on_broker)
        self.cluster = ClusterMetadata()
        self._topics: set[str] = set()
        self.asked: list[set[str]] = []
        self.update()  # the bootstrap: every topic

    def update(self) -> None:
        self.on_broker |= self._topics  # made on demand
        self.asked.append(set(self._topics))
        self.cluster.update_metadata(answer(*sorted(self._topics or self.on_broker)))

    def add_topic(self, topic: str) -> bool:
        self._topics.add(topic)
        self.update()
        return True


class Producer:
    """What ``ProducerTopics`` uses of ``AIOKafkaProducer``; ``send`` asks for the
    topic's partitions as aiokafka's send path does before it queues a batch."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._closed = False
        self._message_accumulator = SimpleNamespace(_batches={})

    def send(self, topic: str) -> Any:
        return self.client.cluster.partitions_for_topic(topic)

    def queue(self, topic: str) -> None:
        self._message_accumulator._batches[TopicPartition(topic, 0)] = deque(["batch"])


def tracked(forget_after_s: float = ROUND_S) -> tuple[Client, Producer, ProducerTopics]:
    client = Client("changelog", "worker", "replies.old")
    producer = Producer(client)
    topics = ProducerTopics(producer, forgettable=is_reply, forget_after_s=forget_after_s)
    return client, producer, topics


def test_aiokafka_s_client_drops_a_known_topic_once_it_tracks_another() -> None:
    client = Client("changelog", "worker")
    assert client.cluster.leader_for_partition(_tp("changelog")) == 1
    client.add_topic("replies.new")
    assert client.cluster.leader_for_partition(_tp("changelog")) is None  # what is fixed


def test_a_topic_sent_to_keeps_its_leader_when_a_new_one_is_tracked() -> None:
    async def main() -> None:
        client, producer, _ = tracked()
        assert producer.send("changelog") == {0}  # known from the all-topics answer
        producer.send("replies.new")
        producer.send("replies.newer")
        for topic in ("changelog", "replies.new", "replies.newer"):
            assert client.cluster.leader_for_partition(_tp(topic)) == 1, topic
        assert client._topics == {"changelog", "replies.new", "replies.newer"}

    asyncio.run(main())


def test_a_topic_never_sent_to_is_never_asked_about() -> None:
    async def main() -> None:
        client, producer, _ = tracked()
        producer.send("changelog")
        producer.send("replies.new")
        assert all("replies.old" not in asked for asked in client.asked)
        assert "replies.old" not in client._topics

    asyncio.run(main())


def test_a_reply_topic_sent_nothing_for_a_round_is_let_go() -> None:
    async def main() -> None:
        client, producer, _ = tracked()
        producer.send("changelog")
        producer.send("replies.a")
        producer.send("replies.b")
        for _ in range(4):  # a's sends go on; b's stopped
            await asyncio.sleep(ROUND_S / 2)
            producer.send("replies.a")
        assert client._topics == {"changelog", "replies.a"}  # changelog is not a reply topic
        # Deleted now, b is not made again by the next metadata request.
        client.on_broker.discard("replies.b")
        client.update()
        assert "replies.b" not in client.on_broker

    asyncio.run(main())


def test_a_reply_topic_with_a_batch_queued_is_kept() -> None:
    async def main() -> None:
        client, producer, _ = tracked()
        producer.send("replies.a")
        producer.queue("replies.a")  # the broker is slow to take it
        await asyncio.sleep(ROUND_S * 3)
        assert "replies.a" in client._topics

    asyncio.run(main())


def test_a_reply_topic_sent_to_again_is_tracked_again() -> None:
    async def main() -> None:
        client, producer, _ = tracked()
        producer.send("replies.a")
        await asyncio.sleep(ROUND_S * 3)
        assert "replies.a" not in client._topics
        assert producer.send("replies.a") == {0}
        assert "replies.a" in client._topics
        assert client.cluster.leader_for_partition(_tp("replies.a")) == 1

    asyncio.run(main())


def test_a_topic_let_go_by_its_sender_is_no_longer_asked_about() -> None:
    async def main() -> None:
        client, producer, topics = tracked(forget_after_s=60)
        producer.send("replies.a")
        producer.send("replies.b")
        producer.queue("replies.b")  # not yet taken by the broker
        topics.let_go("replies.a")
        topics.let_go("replies.b")
        assert client._topics == {"replies.b"}  # b's batch still needs its leader
        client.on_broker.discard("replies.a")  # its client deleted it
        client.update()
        assert "replies.a" not in client.on_broker  # not made again
        producer.send("replies.a")
        assert "replies.a" in client._topics  # sent to again: tracked again

    asyncio.run(main())


def test_rounds_stop_once_no_reply_topic_is_tracked_or_the_producer_closed() -> None:
    async def main() -> None:
        client, producer, _ = tracked()
        producer.send("replies.a")
        await asyncio.sleep(ROUND_S * 3)
        assert not client._topics
        asked = len(client.asked)
        producer._closed = True
        producer.send("replies.b")  # tracked; its round finds the producer closed
        await asyncio.sleep(ROUND_S * 3)
        assert client._topics == {"replies.b"}
        assert len(client.asked) == asked + 1  # only b's own request

    asyncio.run(main())


def test_sent_topics_forgets_only_forgettable_idle_unqueued_topics() -> None:
    topics = SentTopics(is_reply)
    topics.recent.update({"replies.sent", "changelog"})
    tracked_now = {"replies.sent", "replies.idle", "replies.queued", "changelog", "worker"}
    assert topics.forget(tracked_now, ["replies.queued"]) == {"replies.idle"}
    # The next round: nothing sent since.
    assert topics.forget(tracked_now, []) == {"replies.sent", "replies.idle", "replies.queued"}
    assert topics.any_forgettable({"changelog", "replies.x"})
    assert not topics.any_forgettable({"changelog", "worker"})


def test_it_patches_aiokafka_s_own_producer() -> None:
    async def main() -> None:
        producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
        client = producer.client
        client.cluster.update_metadata(answer("changelog", "replies.a"))
        ProducerTopics(producer, forgettable=is_reply, forget_after_s=ROUND_S)
        assert client.cluster.partitions_for_topic("replies.a") == {0}
        assert client._topics == {"replies.a"}
        await asyncio.sleep(ROUND_S * 3)
        assert client._topics == set()

    asyncio.run(main())


def _tp(topic: str) -> Any:
    return TopicPartition(topic, 0)


# -- ExistingTopics: whether a topic exists, found out without making it ---------------------
class AllTopics:
    """What ``ExistingTopics`` uses of aiokafka's client: the metadata it holds (a real
    ``ClusterMetadata``, with a producer's lookup patched to fail, as ``ProducerTopics``'s
    would name the topic to the broker) and an answer about every topic."""

    def __init__(self, held: list[str], on_broker: list[str]) -> None:
        self.cluster = ClusterMetadata()
        self.cluster.update_metadata(answer(*held))
        self.cluster.partitions_for_topic = self._named  # type: ignore[method-assign]
        self.on_broker = on_broker
        self.num_asked = 0
        self.gate: asyncio.Event | None = None

    def _named(self, topic: str) -> Any:
        raise AssertionError(f"{topic} was named to the broker")

    async def fetch_all_metadata(self) -> ClusterMetadata:
        self.num_asked += 1
        on_broker = list(self.on_broker)  # as the question finds the broker
        if self.gate is not None:
            await self.gate.wait()
        every = ClusterMetadata()
        every.update_metadata(answer(*on_broker))
        return every


async def test_a_held_topic_exists_without_asking_and_a_new_one_is_asked_about_once() -> None:
    client = AllTopics(held=["replies.a"], on_broker=["replies.a", "replies.b"])
    exists = ExistingTopics(lambda: client, refresh_s=0.05)
    assert await exists("replies.a") and client.num_asked == 0
    assert await exists("replies.b") and client.num_asked == 1
    assert await exists("replies.b") and client.num_asked == 1  # in the answer held


async def test_lookups_meanwhile_share_one_question() -> None:
    client = AllTopics(held=[], on_broker=["replies.b"])
    client.gate = asyncio.Event()
    exists = ExistingTopics(lambda: client, refresh_s=5.0)
    looks = [asyncio.create_task(exists(t)) for t in ("replies.b", "replies.c", "replies.b")]
    await asyncio.sleep(0)
    client.gate.set()
    assert await asyncio.gather(*looks) == [True, False, True]
    assert client.num_asked == 1


async def test_a_lookup_waits_for_an_answer_asked_after_it_began() -> None:
    # A producer makes its reply topic, then sends a request naming it: the answer asked
    # a moment before does not name it yet, and must not refuse the request. Answers
    # are still asked at most once per refresh_s, however many names come.
    client = AllTopics(held=[], on_broker=["replies.a"])
    exists = ExistingTopics(lambda: client, refresh_s=0.05)
    assert await exists("replies.a") and client.num_asked == 1
    client.on_broker.append("replies.new")
    began = time.monotonic()
    assert await exists("replies.new") and client.num_asked == 2
    looks = [exists(f"replies.ghost-{n}") for n in range(20)]
    assert await asyncio.gather(*looks) == [False] * 20 and client.num_asked == 3
    assert time.monotonic() - began >= 0.1  # two refreshes, not 21 questions


async def test_a_lookup_does_not_settle_for_an_answer_asked_before_it() -> None:
    client = AllTopics(held=[], on_broker=[])
    client.gate = asyncio.Event()
    exists = ExistingTopics(lambda: client, refresh_s=0.01)
    early = asyncio.create_task(exists("replies.new"))
    for _ in range(2):  # the lookup, then its question: asked now, before the topic is made
        await asyncio.sleep(0)
    assert client.num_asked == 1
    client.on_broker.append("replies.new")
    late = asyncio.create_task(exists("replies.new"))
    await asyncio.sleep(0)
    client.gate.set()
    assert await early is False
    assert await late is True and client.num_asked == 2


class Unanswered(AllTopics):
    async def fetch_all_metadata(self) -> ClusterMetadata:
        self.num_asked += 1
        raise KafkaConnectionError("the broker did not answer")


async def test_a_failed_answer_is_taken_as_the_caller_says() -> None:
    # The unproven are not answered on a topic nobody saw; a tenant's request is not
    # refused for the broker's trouble.
    client = Unanswered(held=[], on_broker=["replies.a"])
    exists = ExistingTopics(lambda: client, refresh_s=0.0)
    assert not await exists("replies.a")
    assert await exists("replies.a", assume_on_failure=True) and client.num_asked == 2
