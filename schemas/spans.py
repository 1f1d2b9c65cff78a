"""Spans on the ``spans`` topic: tokenbus's own trace store when no OTLP collector is
configured (``tokenbus.tracing``). Data only."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import SCHEMA_VERSION

HexTraceId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
HexSpanId = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
AttributeValue = str | bool | int | float


class SpanRecord(BaseModel):
    """One finished span, as OpenTelemetry's SDK ended it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trace_id: HexTraceId
    span_id: HexSpanId
    parent_span_id: HexSpanId | None = None
    name: Annotated[str, Field(min_length=1, max_length=256)]
    service: Annotated[str, Field(min_length=1, max_length=64)]
    """``tokenbus-job``, ``tokenbus-worker``, ...: the resource's ``service.name``."""
    start_ns: Annotated[int, Field(ge=0)]
    end_ns: Annotated[int, Field(ge=0)]
    status: Literal["unset", "ok", "error"] = "unset"
    attributes: dict[str, AttributeValue] = Field(default_factory=dict)


class SpanBatch(BaseModel):
    """The spans one service ended in one flush for one tenant, keyed by that tenant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    tenant_id: str
    spans: Annotated[list[SpanRecord], Field(min_length=1)]
