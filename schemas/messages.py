"""Every message on the bus. Data only: nothing here imports another tokenbus package.

Each message carries ``schema_version``. A consumer that meets a version it does not
know sends the message to the dead-letter topic (see ``schemas.codec``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

SCHEMA_VERSION: Literal[1] = 1


def _now() -> datetime:
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
    stop: list[str] = Field(default_factory=list)
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
            internal = sorted(INTERNAL_FIELDS.intersection(data))
            if internal:
                raise ValueError(
                    f"{', '.join(internal)}: set by tokenbus, not by producers "
                    "(the job derives it; leave it out)"
                )
            nulls = sorted(key for key, value in data.items() if value is None)
            if nulls:
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


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REJECTED = "rejected"


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str
    """Machine-readable: ``quota_exceeded``, ``no_worker``, ``engine_error``, ..."""
    message: str
    retry_after_s: float | None = None
    limit_kind: Literal["tokens", "requests"] | None = None
    """On ``quota_exceeded``: the per-minute limit that refused the request."""
    num_limit: int | None = None
    """That limit, per minute."""
    num_remaining: int | None = None
    """What the window has left of it (tokens may be left, just fewer than needed)."""


class TokenChunk(Message):
    """A slice of one request's output, sent to the request's ``reply_to`` topic inside
    a ``TokenChunkBatch`` (never as a record of its own)."""

    request_id: str
    tenant_id: str
    seq: Annotated[int, Field(ge=0)]
    """0, 1, 2, ... per request: a gap or a repeat is visible to the client."""
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    num_tokens: Annotated[int, Field(ge=0)] = 0
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    num_prompt_tokens: Annotated[int, Field(ge=0)] | None = None
    """On the last chunk from a worker: the prompt's length as the engine counted it."""

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


class TokenChunkBatch(Message):
    """The one kind of record on a reply topic, keyed by tenant: chunks of one tenant.

    A worker sends one per engine step per (reply topic, tenant); a single chunk is a
    batch of one. Chunks of one request appear in ``seq`` order, within a batch and
    across the topic's batches.
    """

    tenant_id: str
    chunks: Annotated[list[TokenChunk], Field(min_length=1)]

    @model_validator(mode="after")
    def _one_tenant(self) -> TokenChunkBatch:
        if any(chunk.tenant_id != self.tenant_id for chunk in self.chunks):
            raise ValueError("every chunk must belong to the batch's tenant_id")
        return self


class UsageStatus(StrEnum):
    OK = "ok"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    FAILED = "failed"


class UsageEvent(Message):
    """Exactly one per request attempt, produced to ``usage`` keyed by tenant."""

    request_id: str
    session_id: str
    tenant_id: str
    model: str
    worker_id: str | None = None
    priority: Priority = 1
    attempt: int = 0
    status: UsageStatus
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    error_code: str | None = None
    overload_tier: Annotated[int, Field(ge=0, le=2)] = 0
    precision: str = "fp16"
    """Weights precision (fp32, fp16, bf16, int8), for the cost weights."""
    flags: list[str] = Field(default_factory=list)
    key_sha256: str | None = None
    """The credential's hash the job charged key budgets to (``WorkItem.key_sha256``)."""
    created_at: datetime
    """When the job admitted the request: what prices and peak hours go by."""
    finished_at: datetime = Field(default_factory=_now)
    last_seq: int | None = None
    """The ``seq`` of the request's last chunk, so a duplicate's answer continues it."""
    adapter: str | None = None
    """The LoRA adapter that served it (``model`` is the base model); None: the base."""
    batch_id: str | None = None
    """The batch job the request was a line of (``WorkItem.batch_id``)."""


class WorkerStatus(Message):
    """A worker's heartbeat, produced to ``heartbeats`` keyed by worker id."""

    worker_id: str
    model: str
    request_topic: str
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 1
    kv_cache_usage: float = 0.0
    tokens_per_s: float = 0.0
    draining: bool = False
    incarnation: str = ""
    """Unique to one run of the worker: a new value means the previous run is gone."""
    max_loras: int = 0
    """LoRA adapters one engine step may use; 0: the worker serves no adapters."""
    adapters: list[str] = Field(default_factory=list)
    """Adapters the engine holds now (loaded, up to its ``max_cpu_loras``)."""
    num_adapter_loads: int = 0
    """Adapters this run has loaded (a first use, or again after eviction)."""
    last_adapter_load_ms: float | None = None
    """How long the latest of those loads took."""
    sent_at: datetime = Field(default_factory=_now)


class LoadReport(Message):
    """The job's view of one model's load over the last interval, produced every
    ``load_report_interval_s`` to ``<prefix>.load`` keyed by model: what batch pacers
    read to yield to interactive traffic. Each job instance reports what it holds; a
    reader of several instances' reports tells them apart by ``instance``."""

    model: str
    """The base model (an adapter's requests count under their base)."""
    instance: str
    """The job instance that sent it."""
    interval_s: float
    """The span the interval figures (queue wait, TTFT) cover."""
    num_waiting_by_class: Annotated[list[int], Field(min_length=3, max_length=3)]
    """Requests admitted and waiting at the job for a seat, by class 0, 1, 2."""
    interactive_queue_ms_p50: float | None = None
    """Class 0/1 queue wait (admission to forward) over the interval; None: none sent."""
    interactive_queue_ms_p99: float | None = None
    num_interactive_dispatched: int = 0
    """Class 0/1 requests forwarded in the interval (the queue-wait samples)."""
    interactive_ttft_ms_p50: float | None = None
    """Class 0/1 time to first token, from the UsageEvents of the interval; None: none."""
    interactive_ttft_ms_p99: float | None = None
    num_interactive_finished: int = 0
    """Class 0/1 UsageEvents with a TTFT read in the interval (the TTFT samples)."""
    num_workers: int = 0
    """Live workers serving the model."""
    num_running: int = 0
    """The workers' running requests, summed (their last heartbeats)."""
    num_waiting: int = 0
    """Requests waiting inside the workers' engines, summed."""
    max_num_seqs: int = 0
    """The workers' seats, summed."""
    kv_cache_usage: float = 0.0
    """The highest KV-cache use among the workers (0-1)."""
    num_in_flight: int = 0
    """Requests the job forwarded to the model's workers and has no usage for yet."""
    num_batch_in_flight: int = 0
    """Of those, batch lines (requests with a ``batch_id``)."""
    sent_at: datetime = Field(default_factory=_now)


REASSIGNED = "reassigned"
"""Cancel reason the dispatcher gives when it sends a lost worker's request elsewhere:
a worker that was only presumed dead drops that attempt without a word, so the client
hears one stream and billing one UsageEvent."""


class CancelRequest(Message):
    """A client gave up on a request, produced to ``cancels`` keyed by tenant.

    The job drops it if still queued; the worker running it aborts it in vLLM.
    """

    request_id: str
    tenant_id: str
    reason: str = "client_cancelled"
    """``client_cancelled``, ``timeout``, ... or ``reassigned`` (see ``REASSIGNED``)."""
    attempt: int | None = None
    """Only this attempt of the request; None: whichever attempt runs."""
    sent_at: datetime = Field(default_factory=_now)


class DeadLetter(Message):
    """A message no consumer could parse, with where it came from and why."""

    source_topic: str
    partition: int
    offset: int
    consumer: str
    reason: str
    key: str | None = None
    payload: str
    """The original bytes, decoded as UTF-8 with replacement."""
    failed_at: datetime = Field(default_factory=_now)
