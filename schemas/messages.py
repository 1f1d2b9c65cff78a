"""The bus's base ``Message``, and the request side: what producers send, what the job
hands a worker, cancels and dead letters. Data only: nothing here imports another
tokenbus package.

Each message carries ``schema_version``. A consumer that meets a version it does not
know sends the message to the dead-letter topic (see ``schemas.codec``). Replies, usage
and the fleet's reports have modules of their own (``schemas.replies``,
``schemas.usage``, ``schemas.fleet``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

SCHEMA_VERSION: Literal[1] = 1


def utc_now() -> datetime:
    return datetime.now(UTC)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: Annotated[int, Field(ge=1, le=131_072)] = 256
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    stop: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] = Field(
        default_factory=list
    )
    """At most 16 strings of at most 256 characters: the engine tests every one at each
    step, and they are not counted as prompt tokens."""
    ignore_eos: bool = False


Priority = Annotated[int, Field(ge=0, le=2)]
"""0 VIP, 1 standard, 2 batch."""

TENANT_ID_PATTERN = r"^[A-Za-z0-9_\-]{1,128}$"
"""Letters, digits, ``_`` and ``-``: no dot, so a tenant's reply topics
(``<prefix>.replies.<tenant>.<client>``) never fall under another tenant's prefix."""
TenantId = Annotated[str, Field(pattern=TENANT_ID_PATTERN)]
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_.:\-]{1,128}$"
RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
TopicName = Annotated[str, Field(pattern=r"^[A-Za-z0-9._\-]{1,249}$")]

INTERNAL_FIELDS = frozenset(
    {
        "attempt",
        "worker_id",
        "worker_incarnation",
        "dispatched_at",
        "admitted_at",
        "resume_token_ids",
        "resume_seq",
        "overload_tier",
        "cache_salt",
        "flags",
        "adapter",
        "key_sha256",
    }
)
"""Fields of a ``WorkItem`` that tokenbus derives: a producer that writes one is refused."""


def _no_nulls(schema: JsonDict) -> None:
    """The published schema says what the code accepts: an optional field is left out,
    never ``null`` (see ``InferenceRequest._refuse_nulls_and_internal_fields``)."""
    properties = schema.get("properties")
    assert isinstance(properties, dict)
    for field in properties.values():
        assert isinstance(field, dict)
        options = field.get("anyOf")
        if isinstance(options, list):
            kept = [o for o in options if o != {"type": "null"}]
            if len(kept) == 1 and isinstance(kept[0], dict):
                del field["anyOf"]
                field.update(kept[0])
            else:
                field["anyOf"] = kept
        if field.get("default", 0) is None:
            del field["default"]
    schema["oneOf"] = [
        {"required": ["prompt"], "not": {"required": ["messages"]}},
        {"required": ["messages"], "not": {"required": ["prompt"]}},
    ]


class InferenceRequest(Message):
    """What a producer writes to ``requests.p{priority}``, keyed by its tenant, with its
    credential in the record's ``authorization`` header (see the README).

    The credential names the tenant: ``tenant_id``, if given, must be the same. The
    public half of a request: everything tokenbus derives (attempt, cache salt, tier,
    worker, times, flags) travels in the ``WorkItem`` the job hands a worker."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_no_nulls)

    request_id: RequestId
    """Chosen by the producer, unique within its tenant: a request produced again under
    the same id runs once (see the README's delivery guarantees)."""
    session_id: RequestId | None = None
    """Groups a conversation's turns (affinity, billing); left out: the request's id."""
    tenant_id: TenantId | None = None
    priority: Priority = 1
    model: Annotated[str, Field(min_length=1, max_length=256)]
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    reply_to: TopicName
    """A reply topic this credential owns (``<prefix>.replies.<tenant>.<anything>``, or
    the prefix its token carries)."""
    created_at: AwareDatetime | None = None
    """When the producer made it, with its time zone: used only for latency figures,
    bounded by the job."""
    batch_id: RequestId | None = None
    """The batch job this request is a line of (class 2 only): its own quota budget,
    its own price, and billing's spend per batch."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_nulls_and_internal_fields(cls, data: object) -> object:
        if isinstance(data, dict):
            # The common case (neither) is two C-level scans, not a set and a sort.
            if not INTERNAL_FIELDS.isdisjoint(data):
                internal = sorted(INTERNAL_FIELDS.intersection(data))
                raise ValueError(
                    f"{', '.join(internal)}: set by tokenbus, not by producers "
                    "(the job derives it; leave it out)"
                )
            if None in data.values():  # JSON's values equal None only when null
                nulls = sorted(key for key, value in data.items() if value is None)
                raise ValueError(f"{', '.join(nulls)}: null is not allowed; leave it out")
        return data

    @model_validator(mode="after")
    def _one_input(self) -> InferenceRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' must be given")
        return self


class Adapter(BaseModel):
    """A LoRA adapter as the job resolved it from the tenants file: never a producer's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """Unique across the tenants file; clients address it as ``base:name``."""
    path: str
    lora_int_id: Annotated[int, Field(ge=1)]
    """Stable for one (name, path): the engine's cache key for the adapter."""


class WorkItem(Message):
    """A request as the job hands it to a worker: the producer's request, with the
    tenant its credential proved and every field tokenbus derives. Never produced by
    anyone but the job (Kafka ACLs keep producers off worker topics)."""

    request_id: str
    session_id: str
    tenant_id: str
    priority: Priority = 1
    """The class the job admitted it in (never better than the tenant's)."""
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    reply_to: str
    created_at: datetime
    """The producer's time, bounded by the job: latency figures only."""
    admitted_at: datetime
    """The job's time of admission: prices, peak hours and windows use this."""
    attempt: int = 0
    """Incremented when the request is dispatched again after a worker loss."""
    worker_id: str | None = None
    worker_incarnation: str | None = None
    """The run of that worker the dispatcher addressed; a restarted worker skips others'."""
    dispatched_at: datetime | None = None
    resume_token_ids: list[int] = Field(default_factory=list)
    """Tokens an earlier attempt already streamed; the worker continues after them."""
    resume_seq: int = 0
    """The ``seq`` of this attempt's first chunk, so the client sees one stream."""
    overload_tier: Annotated[int, Field(ge=0, le=2)] = 0
    """0 normal, 1 above 120% of capacity, 2 above 150%."""
    cache_salt: str
    """Prefix-cache isolation key: the tenant, or its sharing group."""
    flags: list[str] = Field(default_factory=list)
    """Notes that travel to the UsageEvent: ``injection_suspected``, ``max_tokens_capped``."""
    adapter: Adapter | None = None
    """The LoRA adapter the request's ``base:adapter`` model named; ``model`` is the base."""
    batch_id: str | None = None
    """The batch job the request is a line of (``InferenceRequest.batch_id``)."""

    @property
    def requested_model(self) -> str:
        """The model name as the client gave it: ``base:adapter`` for an adapter."""
        return f"{self.model}:{self.adapter.name}" if self.adapter else self.model

    key_sha256: str | None = None
    """The SHA-256 of the credential behind the request (an API key, or a token with its
    own balance), as the job charged its budgets: travels to the UsageEvent."""

    @property
    def engine_request_id(self) -> str:
        """Unique on a worker: request ids are unique only within a tenant."""
        return f"{self.tenant_id}/{self.request_id}/{self.attempt}"


REASSIGNED = "reassigned"
"""Cancel reason the dispatcher gives when it sends a lost worker's request elsewhere:
a worker that was only presumed dead drops that attempt without a word, so the client
hears one stream and billing one UsageEvent."""


class CancelRequest(Message):
    """A client gave up on a request, produced to ``cancels`` keyed by tenant.

    The job drops it if still queued; the worker running it aborts it in vLLM.
    """

    request_id: RequestId
    tenant_id: TenantId
    reason: Annotated[str, Field(max_length=256)] = "client_cancelled"
    """``client_cancelled``, ``timeout``, ... or ``reassigned`` (see ``REASSIGNED``)."""
    attempt: int | None = None
    """Only this attempt of the request; None: whichever attempt runs."""
    sent_at: datetime = Field(default_factory=utc_now)


class DeadLetter(Message):
    """A message no consumer could parse, with where it came from and why."""

    source_topic: str
    partition: int
    offset: int
    consumer: str
    reason: str
    key: str | None = None
    payload: str
    """The original bytes, decoded as UTF-8 with replacement; their first
    ``tokenbus.dlq.MAX_PAYLOAD_BYTES`` only, when ``payload_truncated``."""
    payload_bytes: int | None = None
    """The original value's length, in bytes."""
    payload_sha256: str | None = None
    """The original value's SHA-256 (hex): the record at ``offset`` is the whole of it."""
    payload_truncated: bool = False
    failed_at: datetime = Field(default_factory=utc_now)
