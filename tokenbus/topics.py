"""Topic names. Every topic is named here once, and keys always start with the tenant.
``TopicPlan`` says which topics need more than the broker's defaults."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_BATCH_REPLIES = re.compile(
    r"(?P<tenant>[A-Za-z0-9_\-]{1,128})\.batch-(?P<batch_id>batch_[A-Za-z0-9]{8,64})"
)
"""The part of a batch's reply topic after the reply root: ``<tenant>.batch-<batch id>``
(their patterns: ``schemas.TENANT_ID_PATTERN``, ``schemas.batches.BATCH_ID_PATTERN``)."""


@dataclass(frozen=True)
class Topics:
    prefix: str = "tokenbus"

    def requests(self, priority: int) -> str:
        """Client requests of one priority class, keyed by tenant."""
        return f"{self.prefix}.requests.p{priority}"

    @property
    def all_requests(self) -> tuple[str, str, str]:
        return (self.requests(0), self.requests(1), self.requests(2))

    def worker(self, worker_id: str) -> str:
        """Requests the dispatcher forwarded to one worker, keyed by tenant."""
        return f"{self.prefix}.worker.{worker_id}"

    def is_worker_topic(self, topic: str) -> bool:
        root = self.worker("")
        return topic.startswith(root) and len(topic) > len(root)

    def replies(self, client_id: str) -> str:
        """One client's TokenChunkBatches, keyed by tenant (``reply_batch_key``)."""
        return f"{self.prefix}.replies.{client_id}"

    def is_reply_topic(self, topic: str) -> bool:
        """Whether ``topic`` is some client's reply topic (the only place answers go)."""
        root = self.replies("")
        return topic.startswith(root) and len(topic) > len(root)

    def is_batch_reply_topic(self, topic: str) -> bool:
        """Whether ``topic`` is a batch's reply topic (``batch_replies``)."""
        return self.batch_of(topic) is not None

    def batch_of(self, topic: str) -> tuple[str, str] | None:
        """(tenant, batch id) of a batch's reply topic (``batch_replies``), else None."""
        root = self.replies("")
        match = _BATCH_REPLIES.fullmatch(topic[len(root) :]) if topic.startswith(root) else None
        return (match["tenant"], match["batch_id"]) if match else None

    @property
    def usage(self) -> str:
        """One UsageEvent per request attempt, keyed by tenant."""
        return f"{self.prefix}.usage"

    @property
    def cancels(self) -> str:
        """Producers' CancelRequests, with a credential header, keyed by tenant; read by
        the job, which checks them."""
        return f"{self.prefix}.cancels"

    @property
    def aborts(self) -> str:
        """CancelRequests the job checked (and its own ``reassigned``), and the bridges'
        own, keyed by tenant: only tokenbus's services write it, every worker reads it."""
        return f"{self.prefix}.aborts"

    @property
    def spans(self) -> str:
        """Finished spans (``schemas.spans.SpanBatch``), keyed by tenant: tokenbus's own
        trace store when no OTLP collector is configured (``tokenbus.tracing``)."""
        return f"{self.prefix}.spans"

    @property
    def heartbeats(self) -> str:
        """WorkerStatus heartbeats, keyed by worker id."""
        return f"{self.prefix}.heartbeats"

    @property
    def budgets(self) -> str:
        """Runtime budget changes, keyed by budget id (a ``BudgetConfig``, or empty to
        remove one): compacted; written by the bridge's admin API and ``tokenbus budget
        set``, read from the start by every job instance."""
        return f"{self.prefix}.budgets"

    @property
    def budget_alerts(self) -> str:
        """``BudgetAlert``s from the job, keyed by tenant; read by the webhook sender."""
        return f"{self.prefix}.budget-alerts"

    @property
    def load(self) -> str:
        """The job's ``LoadReport``s, keyed by model, one per model every
        ``load_report_interval_s``: read by batch runners to pace their lines."""
        return f"{self.prefix}.load"

    @property
    def batches(self) -> str:
        """``BatchCommand``s (create, cancel) from the bridge and the CLI, keyed
        ``<tenant>/<batch_id>``; read from the start by the batch runners' group."""
        return f"{self.prefix}.batches"

    def batch_replies(self, tenant_id: str, batch_id: str) -> str:
        """One batch's reply topic: its lines' results, the batch's durable log."""
        return self.replies(f"{tenant_id}.batch-{batch_id}")

    @property
    def dead_letters(self) -> str:
        """Messages a consumer could not parse, with the reason."""
        return f"{self.prefix}.dlq"


def reply_batch_key(tenant_id: str) -> bytes:
    """The key of a reply record: a batch holds the chunks of one tenant, of any of its
    requests. Each request's order is its chunks' ``seq``, kept by the topic's order."""
    return tenant_id.encode()


@dataclass(frozen=True)
class TopicPlan:
    """The topic-level configs tokenbus creates topics with (``ensure_topics``); every
    topic not named here takes the broker's defaults. Pure.

    - ``budgets`` is read from its start by every job instance before it admits
      anything, and a budget is written once, when it is set: under Kafka's default
      ``delete`` policy a budget older than the retention (7 days) would be gone at the
      next restart, and its tenant unlimited. Compacted, each budget's latest record
      stays (a removal's empty record too, for ``delete.retention.ms``).
    - ``heartbeats`` and ``load`` are read from their end; a record there is stale in
      seconds. They keep ``live_retention_ms``.
    - The request topics, each worker's topic and every client's reply topic carry
      prompts and generated text, which tokenbus needs there for minutes: they keep
      ``content_retention_ms`` rather than Kafka's 7 days.
    - ``batches`` (read from its start on every assignment of the runners' group) and
      each batch's reply topic (its durable log, read whole when the batch resumes and
      again when it ends) must outlive the longest batch: ``batch_retention_ms``, the
      longest completion window and a margin. A window may be 7 days, Kafka's default
      retention.

    ``segment.ms`` goes with each ``retention.ms``: Kafka deletes whole segments only, and
    a segment of a small topic would otherwise stay open for its default week.
    """

    topics: Topics
    live_retention_ms: int
    batch_retention_ms: int
    content_retention_ms: int

    def named(self) -> dict[str, dict[str, str]]:
        """The configs of the topics the stack creates by name (``tokenbus topics``)."""
        content = _retention(self.content_retention_ms)
        return {
            **{requests: dict(content) for requests in self.topics.all_requests},
            self.topics.budgets: {"cleanup.policy": "compact"},
            self.topics.heartbeats: _retention(self.live_retention_ms),
            self.topics.load: _retention(self.live_retention_ms),
            self.topics.batches: _retention(self.batch_retention_ms),
        }

    def configs(self, topic: str) -> dict[str, str] | None:
        """``topic``'s configs, or None for the broker's defaults."""
        if self.topics.is_batch_reply_topic(topic):
            return _retention(self.batch_retention_ms)
        if self.topics.is_reply_topic(topic) or self.topics.is_worker_topic(topic):
            return _retention(self.content_retention_ms)
        return self.named().get(topic)


def _retention(ms: int) -> dict[str, str]:
    return {"retention.ms": str(ms), "segment.ms": str(ms)}


@dataclass(frozen=True)
class ConfigDrift:
    """A topic config that differs from ``TopicPlan``'s: ``have`` None if unset."""

    topic: str
    name: str
    want: str
    have: str | None


def config_drift(
    want: Mapping[str, Mapping[str, str]], have: Mapping[str, Mapping[str, str]]
) -> list[ConfigDrift]:
    """Each wanted config that an existing topic (a key of ``have``: its configs as the
    broker describes them) lacks or holds another value for. Topics not in ``have``
    (not created yet) have no drift. Pure."""
    return [
        ConfigDrift(topic, name, value, have[topic].get(name))
        for topic, configs in want.items()
        if topic in have
        for name, value in configs.items()
        if have[topic].get(name) != value
    ]


def replication_advice(replication_factor: int, num_brokers: int) -> str | None:
    """What to say when topics are made with fewer copies than the cluster allows (up to
    3, Kafka's usual), else None. Pure."""
    wanted = min(3, num_brokers)
    if replication_factor >= wanted:
        return None
    return (
        f"topics are made with replication factor {replication_factor} on a cluster of "
        f"{num_brokers} brokers: a broker lost loses the records it held alone; set "
        f"TOKENBUS_REPLICATION_FACTOR={wanted} (and min.insync.replicas={wanted - 1} on the "
        "brokers, for acks=all to mean it); topics made already keep their copies until "
        "kafka-reassign-partitions.sh adds replicas"
    )
