"""A producer's metadata keeps every topic it knows (aiokafka's client, patched per
instance by ``keep_known_topics``).

# add_topic(new) --> tracked topics := known topics + new --> metadata asked for all of them

aiokafka's client asks for the metadata of every topic while it tracks none, and only
for the topics it tracks once it tracks one. A producer tracks a topic only when it
sends to one its metadata lacks: a topic it learned of from an all-topics answer is
sent to without being tracked. So the first new topic (a reply topic, a topic created
since the start) makes the next answer leave every such topic out, and a batch already
queued for one of them finds no leader: it waits, asking again for the same tracked
topics, until it expires (``request_timeout_ms``), and every flush waits with it. In
the Faust job that was a changelog record of the quota window: Faust's commit flushes
the producer first, so commits stopped for 30 s, and a SIGTERM waited in
``Consumer.wait_empty`` behind that commit.

Tracking every known topic from the first ``add_topic`` on keeps the answers whole: the
metadata then only ever holds tracked topics, so none can drop out.
"""

from __future__ import annotations

from typing import Any


def keep_known_topics(client: Any) -> None:
    """Makes ``client`` (an ``aiokafka.client.AIOKafkaClient``) track every topic in its
    metadata whenever it starts tracking a new one."""
    add_topic = client.add_topic

    def add_known_topics_too(topic: str) -> Any:
        client._topics.update(client.cluster.topics())
        return add_topic(topic)

    if client._topics:  # installed late: what is known now is kept from here on
        client._topics.update(client.cluster.topics())
    client.add_topic = add_known_topics_too
