"""What the serving fleet says of its load: a worker's heartbeat, and the job's report
per model that batch pacers read."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from schemas.messages import Message, utc_now


class WorkerStatus(Message):
    """A worker's heartbeat, produced to ``heartbeats`` keyed by worker id."""

    worker_id: str
    model: str
    request_topic: str
    num_running: Annotated[int, Field(ge=0)] = 0
    num_waiting: Annotated[int, Field(ge=0)] = 0
    max_num_seqs: Annotated[int, Field(ge=1)] = 1
    kv_cache_usage: Annotated[float, Field(ge=0.0)] = 0.0
    tokens_per_s: Annotated[float, Field(ge=0.0)] = 0.0
    draining: bool = False
    incarnation: str = ""
    """Unique to one run of the worker: a new value means the previous run is gone."""
    max_loras: Annotated[int, Field(ge=0)] = 0
    """LoRA adapters one engine step may use; 0: the worker serves no adapters."""
    adapters: list[str] = Field(default_factory=list)
    """Adapters the engine holds now (loaded, up to its ``max_cpu_loras``)."""
    num_adapter_loads: Annotated[int, Field(ge=0)] = 0
    """Adapters this run has loaded (a first use, or again after eviction)."""
    last_adapter_load_ms: float | None = None
    """How long the latest of those loads took."""
    sent_at: datetime = Field(default_factory=utc_now)


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
    sent_at: datetime = Field(default_factory=utc_now)
