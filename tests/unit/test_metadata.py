"""A producer's metadata keeps every topic it knows once it tracks one (aiokafka's client
asks only for the tracked topics from then on)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.protocol.metadata import MetadataResponse_v0

from tokenbus.metadata import keep_known_topics


def answer(*topics: str) -> Any:
    """A metadata answer naming broker 1 as the leader of partition 0 of each topic."""
    return MetadataResponse_v0(
        [(1, "127.0.0.1", 9092)], [(0, topic, [(0, 0, 1, [1], [1])]) for topic in topics]
    )


class Client:
    """What ``keep_known_topics`` uses of aiokafka's client, with its own ``add_topic``:
    the broker answers for the tracked topics only, all of them while none is tracked."""

    def __init__(self, *on_broker: str) -> None:
        self.on_broker = set(on_broker)
        self.cluster = ClusterMetadata()
        self._topics: set[str] = set()
        self.update()  # the bootstrap: every topic

    def update(self) -> None:
        self.cluster.update_metadata(answer(*sorted(self._topics or self.on_broker)))

    def add_topic(self, topic: str) -> bool:
        self.on_broker.add(topic)
        self._topics.add(topic)
        self.update()
        return True


def test_aiokafka_s_client_drops_a_known_topic_once_it_tracks_another() -> None:
    client = Client("changelog", "worker")
    assert client.cluster.leader_for_partition(_tp("changelog")) == 1
    client.add_topic("replies.new")
    assert client.cluster.leader_for_partition(_tp("changelog")) is None  # what is fixed


def test_every_known_topic_keeps_its_leader_when_a_new_one_is_tracked() -> None:
    client = Client("changelog", "worker")
    keep_known_topics(client)
    client.add_topic("replies.new")
    client.add_topic("replies.newer")
    for topic in ("changelog", "worker", "replies.new", "replies.newer"):
        assert client.cluster.leader_for_partition(_tp(topic)) == 1, topic
    assert client._topics == {"changelog", "worker", "replies.new", "replies.newer"}


def test_installed_after_a_topic_is_tracked_it_keeps_what_is_known_then() -> None:
    client = Client("changelog", "worker")
    client._topics.add("replies.new")  # tracked, the answer for it not in yet
    keep_known_topics(client)
    client.update()
    assert client.cluster.leader_for_partition(_tp("changelog")) == 1


def test_it_patches_aiokafka_s_own_client() -> None:
    async def main() -> None:
        client = AIOKafkaClient(bootstrap_servers="127.0.0.1:1")
        client.cluster.update_metadata(answer("changelog"))
        keep_known_topics(client)
        client.add_topic("replies.new")
        assert client._topics == {"changelog", "replies.new"}

    asyncio.run(main())


def _tp(topic: str) -> Any:
    from aiokafka.structs import TopicPartition

    return TopicPartition(topic, 0)
