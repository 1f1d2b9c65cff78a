"""Batch jobs: the commands on ``<prefix>.batches``, the lines the runner produces, and
OpenAI's batch and file objects as the bridge returns them. Data only.

The OpenAI shapes mirror ``openai.types.Batch`` and ``openai.types.FileObject`` field
for field (a unit test parses them with the ``openai`` package; it is not imported here:
the services run without it). A batch's status document in the store is ``BatchDoc``:
OpenAI's object plus tokenbus's own fields, which the bridge also returns (the client
ignores what it does not know).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import ChatMessage, Message, SamplingParams

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions"]
BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
TERMINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
BATCH_ID_PATTERN = r"^batch_[A-Za-z0-9]{8,64}$"
FILE_ID_PATTERN = r"^file-[A-Za-z0-9]{8,64}$"
BatchId = Annotated[str, Field(pattern=BATCH_ID_PATTERN)]
FileId = Annotated[str, Field(pattern=FILE_ID_PATTERN)]
"""Ids the bridge mints (unguessable: 128 random bits); no dot, so a line's request id
``<batch_id>.<line_no>`` parses back."""


class BatchCommand(Message):
    """A record on ``<prefix>.batches``, keyed ``<tenant>/<batch_id>``: only tokenbus's
    services (the bridge, the CLI) write it, after checking the tenant."""

    kind: Literal["create", "cancel"]
    tenant_id: str
    batch_id: BatchId


class PreparedLine(BaseModel):
    """One input line as checked at submit time: what the runner produces for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    line_no: Annotated[int, Field(ge=1)]
    custom_id: str
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams
    flags: list[str] = Field(default_factory=list)
    """What the bridge's screening raised for this line (``injection_suspected``, ...),
    as it would for the same request sent alone: the job and billing see them alike."""


class BatchCredential(BaseModel):
    """What the credential that created a batch binds its lines to, as the same credential's
    own requests are bound: its key's budgets and usage (``key_sha256``), and its token's
    ``quota_balance``. Kept with the batch, never shown by the API."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key_sha256: str | None = None
    quota_balance: Decimal | None = None


class LineError(BaseModel):
    """A line that will not run, and why: it becomes an error line."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    line_no: Annotated[int, Field(ge=1)]
    custom_id: str | None = None
    code: str
    message: str


class RequestCounts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(BaseModel):
    """``openai.types.BatchError``."""

    model_config = ConfigDict(extra="forbid")

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["list"] = "list"
    data: list[BatchErrorItem] = Field(default_factory=list)


class TokenDetails(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cached_tokens: int = 0


class OutputDetails(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """``openai.types.BatchUsage``: the tokens of the lines done so far."""

    model_config = ConfigDict(extra="forbid")

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: TokenDetails = Field(default_factory=TokenDetails)
    output_tokens_details: OutputDetails = Field(default_factory=OutputDetails)


class BatchDoc(BaseModel):
    """A batch's status document (``<root>/<tenant>/batches/<batch_id>.json``), as
    ``GET /v1/batches/{id}`` returns it. Times are epoch seconds, as OpenAI's."""

    model_config = ConfigDict(extra="forbid")

    id: BatchId
    object: Literal["batch"] = "batch"
    endpoint: BatchEndpoint
    input_file_id: FileId
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    errors: BatchErrors | None = None
    usage: BatchUsage = Field(default_factory=BatchUsage)
    model: str | None = None
    # -- tokenbus's own -------------------------------------------------------------------
    tenant: str
    credential: BatchCredential | None = None
    """The creating credential's bounds (None: an operator's batch, the tenant's own)."""
    in_flight: int = 0
    eta_s: float | None = None
    """Seconds to completion at the recent pace; None until there is a pace."""

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class FileDoc(BaseModel):
    """``openai.types.FileObject``, stored beside the file as ``<file_id>.json``."""

    model_config = ConfigDict(extra="forbid")

    id: FileId
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    tenant: str

    def public(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"tenant"})


class LineResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status_code: int
    request_id: str
    body: dict[str, Any]


class LineErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    message: str


class OutputLine(BaseModel):
    """One line of an output or error file, in OpenAI's format."""

    model_config = ConfigDict(extra="forbid")

    id: str
    custom_id: str | None
    response: LineResponse | None = None
    error: LineErrorBody | None = None
