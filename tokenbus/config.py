"""The one configuration model: every service reads its settings from here.

Values come from ``TOKENBUS_*`` environment variables (nested fields use ``__``), and
tests override them through the constructor. Nothing reads the environment at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenbus.tenants import TenantConfig, TenantDirectory
from tokenbus.topics import Topics

if TYPE_CHECKING:
    from tokenbus.auth import Authenticator


def _default_home() -> Path:
    return Path.cwd() / ".tokenbus"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENBUS_", env_nested_delimiter="__")

    # -- where things live --------------------------------------------------------
    home: Path = Field(default_factory=_default_home)
    """State of the local stack: broker port, model cache, ClickHouse data, pid file."""

    debug_loggers: list[str] = []
    """Loggers (e.g. ``workers.replies``) to log at DEBUG; the rest log at INFO."""
    trace_sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of traces kept, decided where a trace starts (a request without a sampled
    ``traceparent``) and followed by every service after it; 0 turns tracing off."""
    otlp_endpoint: str | None = None
    """An OTLP/HTTP collector (``http://host:4318``): spans go there. Unset: to the
    ``spans`` topic and ClickHouse, for ``tokenbus trace``."""
    trace_flush_interval_s: float = Field(default=1.0, gt=0.0)
    """How often a service sends the spans it ended to the ``spans`` topic."""
    span_gather_s: float = Field(default=3.0, gt=0.0)
    """How long the span sink gathers span batches for one ClickHouse insert, from the
    first it fetches. Each insert costs ClickHouse a fixed CPU time whatever its size
    (10 to 25 ms), most of the span sink's work per request at 3 s: a longer gather
    costs less CPU per span but makes a larger burst on billing's core, and a span
    reaches ``tokenbus trace`` later (up to ``trace_flush_interval_s`` + ``span_gather_s``
    after it ended). BENCHMARKS.md measured 10 s against 3 s."""
    log_format: Literal["text", "json"] = "text"
    """``json``: one JSON object per line, with the request's tenant, ids and trace on
    every line about a request (``tokenbus.logs``)."""
    metrics_top_tenants: int = Field(default=20, ge=0)
    """Tenants named in a service's metrics (``tenant`` label): the N with the most recent
    traffic there; every other tenant is counted as ``other`` (tokenbus.metrics)."""
    metrics_tenant_half_life_s: float = Field(default=300.0, gt=0.0)
    """How fast a tenant's traffic is forgotten when the top N are chosen."""
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    """Every service's event loop (tokenbus.loops; uvicorn takes the same names). uvloop
    runs the same code on less CPU, and on two cores that CPU is the engine's
    (BENCHMARKS.md); ``asyncio`` is the standard loop, to compare or to debug."""

    gc_gen0_threshold: int = Field(default=50_000, ge=0, le=1_000_000)
    """Every service process (the Faust job, a worker, the bridge) collects its youngest
    generation after this many allocations, not CPython's 700, once it has frozen what
    start-up made (tokenbus.heap). 0: CPython's thresholds; at most a million. In an
    admission burst the job spent a tenth of its CPU in full collections at 700, and at
    10,000 still 4% in middle ones, each walking the requests in flight that young
    collections had moved there; at 50,000 those die first (BENCHMARKS.md)."""

    # -- Kafka ----------------------------------------------------------------------
    broker_profile: Literal["kafka", "tansu"] = "kafka"
    """The broker tokenbus talks to. ``kafka``: Apache Kafka (or any broker that behaves
    like it), no workaround, idempotent producers. ``tansu``: the bundled development
    broker, with tokenbus.tansu's workarounds and no idempotence (tansu has no
    InitProducerId). ``tokenbus up`` sets ``tansu`` when it runs the bundled broker."""
    kafka_bootstrap: str | None = None
    """``host:port[,host:port]``. Unset: ``tokenbus up`` starts the bundled tansu broker."""
    kafka_port: int = 19092
    """Port of the bundled broker when ``kafka_bootstrap`` is unset."""
    kafka_host: str = "127.0.0.1"
    """Address the bundled broker listens on and advertises: loopback, or another local
    address (the chaos matrix's veth, which a worker in a namespace of its own reaches)."""
    kafka_broker_threads: int = Field(default=1, ge=1, le=256)
    """Threads of the bundled broker's async runtime (tokio's ``TOKIO_WORKER_THREADS``;
    left to itself, tansu runs one per core). With one, a request is read, answered and
    its waiting fetches woken on the same thread, rather than handed between two. On
    this two-core machine at concurrency 64 it used 45 µs of CPU per token against 56
    with two, and the same hop latency (BENCHMARKS.md). Only the broker ``tokenbus up``
    starts; a Kafka cluster is untouched."""
    topic_prefix: str = "tokenbus"
    num_partitions: int = 4
    """Partitions of the request and usage topics; the unit of scale-out."""
    replication_factor: int = 1
    live_topic_retention_ms: int = Field(default=3_600_000, ge=60_000)
    """How long the heartbeat and load-report topics keep their records (their
    ``retention.ms`` and ``segment.ms``, set when tokenbus creates them). Their readers
    start from the end, and a report minutes old says nothing about now; left at the
    broker's default (7 days on Kafka), each worker's two heartbeats a second would pile
    up for a week."""
    content_topic_retention_ms: int = Field(default=86_400_000, ge=3_600_000)
    """How long the topics that carry prompts and generated text keep them (their
    ``retention.ms``, set when tokenbus creates them): the request topics, each worker's
    topic and every client's reply topic (a batch's keeps ``batch_topic_retention_ms``).
    tokenbus needs a record there for minutes (until its request is forwarded, adopted
    after a restart, or read back on failover); Kafka's default would keep every prompt
    and answer for 7 days. At least an hour."""
    kafka_acks: int | str = "all"
    kafka_idempotence: bool | None = None
    """Idempotent producers; unset: on with the ``kafka`` profile, off with ``tansu``
    (idempotence needs InitProducerId, which the bundled broker lacks)."""
    linger_ms: int = 0
    producer_batch_bytes: int = Field(default=262_144, ge=16_384, le=1_000_000)
    """The most a producer batches for one partition (every producer's, the Faust job's
    too), under Kafka's default message and request limits of about 1 MB. aiokafka's
    default, 16 KiB, held about fifteen of the job's forwards: in a burst each send then
    waited for the partition's batch to drain, and each produce request carried less. At
    256 KiB the job admitted 3,236 and 3,509 requests per core against 2,774 and 2,786
    (alternated pairs), the broker's CPU per request down by a third (BENCHMARKS.md)."""
    max_request_record_bytes: int = Field(default=900_000, ge=4_096, le=1_000_000)
    """The largest request record (its value) the job admits; a larger one is refused
    with ``request_too_large``. The job's forward of a request is the request with the
    fields it derives (a few hundred bytes), and must fit one record: the producers'
    1 MB ``max_request_size``, Kafka's default message limit."""
    fetch_max_wait_ms: int | None = Field(default=None, ge=0)
    """How long the broker may hold a fetch of an idle partition: every consumer but the
    Faust job's (``consumer_fetch_wait_ms`` resolves it). Unset: 500 ms with the ``kafka``
    profile, Kafka's own default, since Apache Kafka answers a parked fetch as soon as a
    record arrives, so a long wait costs no latency and saves the polling; 20 ms with
    ``tansu``, which answers later the longer the wait, while a short wait keeps idle
    consumers polling it. Measured through the whole pipeline on tansu at concurrency 1
    (worker to client p50; pipeline CPU per 1k tokens): 5 ms 6 ms, 10.5 s; 20 ms 9 ms,
    6.6 s; 100 ms 21 ms, 3.9 s (BENCHMARKS.md). Later, with the job's wait set alike, 2 ms
    took the c=1 added TTFT p50 from 17.6 to 11.2 ms for 2.7 times the pipeline's CPU
    per token, and 1 ms no further: the polling slows the engine."""
    background_fetch_max_wait_ms: int | None = Field(default=None, ge=0)
    """The same, for consumers whose records no request waits on: the job's heartbeat
    and budget readers, the workers' aborts, billing's usage, span and alert sinks, the
    alerts service, and the batch runner's commands and load reports
    (``background_fetch_wait_ms`` resolves it; never below ``consumer_fetch_wait_ms``).
    Unset: 500 ms with ``kafka``, as every consumer there; 100 ms with ``tansu``, where
    each idle consumer polls the broker: at 20 ms they cost the idle stack about a third
    of a core, broker included (BENCHMARKS.md)."""
    job_fetch_max_wait_ms: int = Field(default=20, ge=1)
    """The same, for the Faust job's consumer (``tansu`` profile only; tansu never
    answers a fetch parked at 0 ms). It holds many partitions, and one left out of a
    parked fetch (its records still buffered, or paused by Faust's flow control) waits
    for that fetch to end: at 100 ms the job's intake lag rose from p50 6 to 13 ms to 26
    to 35 ms, and class 0's submit to dispatch p99 from 17 to 52 ms. At 5 ms its polling
    was most of the job's CPU at concurrency 64 (98 against 43 µs per token at 20 ms).
    At 10 ms the c=1 added TTFT p50 was 14.9 against 17.0 ms and its p90 about 20
    against 31, but the job's CPU per token at c=64 13.8 against 10.6 µs, which took
    tokenbus's processes past issue 17's 30 µs per token (33.1; BENCHMARKS.md): a
    development stack that wants the lower latency can set 10."""
    fetch_max_wait_cap_ms: int = 1_000
    """A consumer whose fetches keep coming back empty behind the high-water mark
    doubles its fetch wait up to this (tokenbus.tansu.fetch_wait: the bundled broker's
    fetch costs more as a partition grows, and stops at the wait). ``tansu`` profile
    only; 0 turns it off."""
    eager_fetch_wait_ms: int = Field(default=2, ge=0, le=1_000)
    """The fetch wait of a consumer that expects a record soon (tokenbus.tansu.fetch_wait:
    the bundled broker looks at a parked fetch at about 58%, 84% and 98% of its wait, so
    a record that lands early in a fetch waits over half the wait). Where requests come
    one at a time, as from a caller that sends its next when its last one ends: a worker
    gone idle, a client sending a request, the Faust job when a lone record comes after
    a quiet spell. Each fetches with this wait until a record comes, for at most
    ``eager_fetch_window_ms``; under concurrent load none of them does. ``tansu``
    profile only; 0 turns it off."""
    eager_fetch_window_ms: int = Field(default=50, ge=1, le=10_000)
    """How long such a consumer keeps the short wait without a record; for the Faust job
    also how long without records counts as a quiet spell."""
    reply_topic_roll_records: int | None = Field(default=None, ge=0)
    """A client (the bridge's, a program's) moves its replies to a fresh reply topic once
    the current one holds this many records, and deletes the old one once no stream of
    its own reads there (``reply_topic_records`` resolves it; 0: never). Unset: 1,000
    with the ``tansu`` profile, whose fetch costs it more the more record batches the
    partition holds: a consumer tailing a partition while 30 records a second arrive cost
    it 0.06 cores empty, 0.10 at 1,000 batches, 0.25 at 5,000 and 0.51 at 10,000
    (``bench.fetch_cost``), so a long-lived client's reply topic made the whole machine
    slower by the hour. Never with ``kafka``, where a fetch costs the same at any length
    and retention trims the log."""
    reply_topic_forget_s: float = Field(default=10.0, gt=0, le=3600)
    """A producer stops asking the broker about a reply topic it has sent nothing to for
    this long (between one and two times it; ``tokenbus.metadata``). A broker that makes
    topics on demand (the bundled one; Apache Kafka with ``auto.create.topics.enable``)
    makes a deleted topic again, empty, whenever a producer still asks about it: so a
    client's deleted reply topics came back at every refresh of every producer that had
    ever known them. A client deletes a rolled-off topic a second time once this has
    passed twice over, in case a producer asked about it in between. At most an hour."""
    request_timeout_ms: int = 30_000
    kafka_gap_settle_s: float = 5.0
    """A consumer that meets an offset gap in a tokenbus topic fetches again for this
    long before it accepts the gap (tokenbus.tansu.gaps: the bundled broker can show a
    later batch before an earlier one). ``tansu`` profile only; 0 turns it off."""

    # -- Faust job ------------------------------------------------------------------
    faust_app_id: str = "tokenbus-dispatch"
    faust_session_timeout_s: float = 4.0
    faust_rebalance_timeout_s: float = 4.0
    faust_heartbeat_interval_s: float = 1.0
    faust_commit_interval_s: float = 1.0
    """How often Faust commits acked offsets; a crash redelivers at most this much."""

    faust_datadir: Path | None = None
    """The job instance's Faust data directory; unset: ``<home>/faust``. Every instance
    needs one of its own: Faust keeps its table state and a lock there."""
    faust_web_port: int | None = None
    """Serves the job's ``/metrics`` here; unset, the job runs no web server."""
    faust_web_host: str = "127.0.0.1"
    """The address the job's web server binds (``0.0.0.0`` for a Prometheus elsewhere)."""
    job_metrics_url: str | None = None
    """The job's ``/metrics``, read by the billing page's live view; unset:
    ``http://127.0.0.1:<faust_web_port>/metrics`` when that port is set."""
    batch_metrics_url: str | None = None
    """A batch runner's ``/metrics``, whose batches' progress the live view shows; unset:
    ``http://127.0.0.1:<batch_port>/metrics``."""
    scaling_target_utilisation: float = Field(default=0.8, gt=0.0, le=1.0)
    """Share of a worker's seats the recommended worker count plans to fill
    (``tokenbus_recommended_workers``, stream_jobs.scaling)."""
    scaling_min_workers: int = Field(default=1, ge=0)
    scaling_max_workers: int = Field(default=16, ge=0)
    job_intake_stall_s: float = 15.0
    """A request partition the job is behind on and has taken nothing of for this long is
    logged with where its consumer stands (stream_jobs.intake_watch); 0 turns it off."""
    admit_concurrency: int = 256
    """Requests per priority topic the job holds at once, waiting for capacity."""
    admit_batch_max: int = 256
    """The most requests the admit agent takes from its stream in one batch (it takes
    what is ready, and never waits for a clock to fill a batch)."""
    admit_batch_turns: int = 4
    """Event loop turns the admit agent gives Faust's fetcher to hand over the rest of a
    fetch before it judges the batch it holds (microseconds, not a linger)."""

    # -- who may produce (tokenbus.auth) ----------------------------------------------------
    tenants_file: Path | None = None
    """TOML or JSON with a ``tenants`` table (see tokenbus.tenants): tenants, API keys."""
    allow_unlisted_tenants: bool = False
    """Whether a tenant that a trusted token names but the tenants file does not list is
    served, on the ``default_*`` limits. Off: such a token is refused (``unknown_tenant``).
    API keys always belong to a listed tenant."""
    jwt_audience: str = "tokenbus"
    jwt_hs256_secret: str | None = None
    """Verifies tenant JWTs signed HS256, on the bridge and on the bus alike."""
    jwt_rs256_public_key: str | None = None
    """PEM text of the key that verifies RS256 tenant JWTs."""
    jwt_leeway_s: float = 5.0
    bus_service_secret: str | None = None
    """Signs the service tokens tokenbus's own services (the bridge) put on the requests
    they produce for a tenant they authenticated. Share it between the bridges and the
    job, and with nothing else. Unset: no service token is accepted (or minted)."""
    request_dedupe_s: float = Field(default=900.0, ge=60.0, le=30 * 86_400)
    """How long the job remembers a finished request's id, per tenant: the same id
    produced again within this answers ``duplicate_request`` instead of running again.
    At least the quota window's minute: the same entry keeps the request's reservation."""
    created_at_skew_s: float = 300.0
    """A producer's ``created_at`` is clamped into [admission - this, admission]: it only
    feeds latency figures; prices and windows use the time of admission."""

    # -- admission and scheduling ------------------------------------------------------
    default_tpm: int = 1_000_000
    default_rpm: int = 6_000
    default_batch_tpm: int = 1_000_000
    """Tokens per minute of batch lines (requests with a ``batch_id``) for a tenant whose
    entry sets no ``batch_tpm``: charged to a window of their own (``<tenant>/batch``),
    never to the tenant's interactive TPM, and not held by its RPM either. A batch line
    over it is refused with ``quota_exceeded`` and ``retry_after_s``, which the batch
    runner waits out."""
    batch_max_waiting_per_seat: float = Field(default=4.0, gt=0)
    """Batch lines (requests with a ``batch_id``) that may wait at the job, per seat of the
    fleet (at least one seat counted). They are not overload demand (tiers leave them out:
    they fill idle seats), so this bounds them instead: a line beyond it is refused
    ``overloaded`` with ``retry_after_s``, which the batch runner waits out (its pacer
    keeps far fewer in flight). It holds off a producer that sends lines faster than the
    fleet takes them."""
    default_burst_s: float = 0.0
    """Spending smoothing for tenants not in the tenants file (see TenantConfig.burst_s)."""
    default_priority_class: int = 1
    """The best class a tenant not in the tenants file may use (0 VIP, 1, 2 batch)."""
    tenant_tpm: dict[str, int] = Field(default_factory=dict)
    """Per-tenant tokens-per-minute overrides, e.g. ``{"acme": 20000}``."""
    vip_reserve: float = 0.3
    """Fraction of the fleet's seats that classes 1 and 2 may not fill, kept for class 0.

    vLLM does not preempt a running request to seat a waiting one of higher priority,
    so a class 0 request that found every seat taken would wait for a batch request to
    finish. With seats held back it starts at once. Size it for class 0's peak: its
    request rate times how long one holds a seat, over the fleet's seats. (Measured:
    class 0 at 20 requests/s, each holding a seat 0.4 to 0.9 s on the loaded 2-core
    machine, needed 8 to 18 of 64 seats; at 0.2 it waited up to 0.8 s when slow.)"""
    batch_yield_seats_per_worker: int = 4
    """While a model has class 0/1 requests in flight, or queued one in the last
    ``batch_yield_hold_s``, class 2 may hold at most this many seats per live worker of
    that model; the job forwards none above it, and class 0/1 requests do not wait for
    their seats (``tokenbus.batch_yield``). Each worker holds the same cap over the lines
    in its engine, pausing those above it (``workers.batch_gate``: they go on later from
    the tokens they made). It acts on the first interactive request,
    where the batch pacer acts a load report later. A value at or above the workers'
    ``max_num_seqs`` never binds: the seats and the pacer alone. (Measured before it, on
    the 2-core machine: with 44 batch lines seated, interactive TTFT p99 at c=1 was 5.9x
    its value alone; BENCHMARKS.md, section 7.)"""
    batch_yield_probe_after: int = 32
    """Interactive requests a worker serves in a row within the target (its TTFT at most
    ``batch_target_interactive_ratio`` x its baseline) before it lets one more batch line
    run beside them, up to ``batch_yield_seats_per_worker`` (``workers.batch_gate``: AIMD
    from none; a request over the target with batch lines running halves them)."""
    batch_yield_probe_after_max: int = Field(default=1024, ge=1)
    """The most interactive requests between two probes: each probe that fails (a request
    over the target beside the line it added) doubles the wait, from
    ``batch_yield_probe_after`` up to this; one that holds brings it back."""
    batch_yield_hold_s: float = 3.0
    """How long the batch yield's cap outlives the last interactive request's arrival
    (at a worker, also its end):
    long enough to bridge the gaps within a burst, short against the batch's recovery."""
    tier_cap_above: float = 1.2
    tier_shed_above: float = 1.5
    tier_capped_max_tokens: int = 256

    # -- batch jobs: load reports and pacing (batches.pacing) ----------------------------
    load_report_interval_s: float = 1.0
    """How often the job publishes a ``LoadReport`` per model to ``<prefix>.load``."""
    batch_max_in_flight: int = 64
    """The most lines of one batch in flight at once: the fixed pacer's limit, and the
    adaptive pacer's ceiling."""
    batch_target_interactive_ratio: float = 1.5
    """A pacer backs off while interactive (class 0/1) queue wait or TTFT p99 is above
    this times its baseline (measured while batch lines were few), or while interactive
    requests wait at the job for a seat."""
    batch_target_floor_ms: float = 50.0
    """Interactive queue-wait p99 at or below this never counts as pressure, whatever the
    baseline: a few milliseconds' jitter must not stop a batch."""
    batch_target_ttft_floor_ms: float = 100.0
    """The same floor for interactive TTFT p99."""

    # -- routing (stream_jobs.routing) ---------------------------------------------------
    route_weight_kv: float = 5.0
    """Weight of the KV-cache use above ``route_kv_threshold``."""
    route_weight_queue: float = 0.3
    """Weight of (waiting + dispatched-but-unseen) / capacity."""
    route_weight_load: float = 0.2
    """Weight of running / capacity."""
    route_kv_threshold: float = 0.9
    """A worker above this KV-cache use gets no new work while another is below it."""
    route_priority_bonus: tuple[float, float, float] = (0.1, 0.05, 0.0)
    affinity_margin: float = 0.25
    """A session stays on its worker while that worker scores within this of the best."""
    adapter_margin: float = 0.25
    """A request for a LoRA adapter goes to a worker that holds it, and has room, while
    that worker scores within this of the best (stream_jobs.adapter_routing)."""
    affinity_sessions: int = 100_000
    """Sessions whose worker the job remembers (least recently used are forgotten)."""

    # -- workers ----------------------------------------------------------------------
    worker_id: str = "worker-0"
    model_path: Path | None = None
    """A Hugging Face model directory. Unset: the tiny model built into ``home``."""
    served_model_name: str = "tiny-llama"
    max_num_seqs: int = 64
    max_model_len: int = 16_384
    kv_cache_gib: float = 1.0
    """KV-cache memory per worker; fractions are fine (0.004 GiB: 4k tokens of the tiny model)."""
    dtype: str = "float32"
    precision: str | None = None
    """What billing calls the served weights (``int8`` for a quantized model); default: dtype."""
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    max_loras: int = 0
    """LoRA adapters one engine step may use (vLLM's ``max_loras``); 0: LoRA is off and
    the worker serves the base model only. Workers with it on report their adapters."""
    max_cpu_loras: int | None = None
    """Adapters a worker keeps loaded (vLLM's ``max_cpu_loras``, least recently used
    evicted); unset: ``max_loras``."""
    max_lora_rank: int = 16
    """The largest adapter rank a worker accepts."""
    stream_interval: int = Field(default=1, ge=1, le=1024)
    """Tokens of one request vLLM gathers before it hands them on (its ``stream_interval``,
    per request): 1 streams each token as it is made; more cut the worker's, the broker's
    and the client's work per token for a coarser stream. A request's first token and its
    end go at once whatever the interval."""
    batch_stream_interval: int = Field(default=16, ge=1, le=1024)
    """The same for class 2 requests (batch lines), never below ``stream_interval``: no one
    reads a batch line as it streams (the runner collects it whole), so its tokens go in
    fewer, larger reply chunks. A line paused for interactive work sends the tokens it
    held with the pause, so it goes on from all it made."""
    worker_metrics_port: int | None = None
    """Serves the worker's ``/metrics`` and ``/healthz`` here; unset, none (the local
    stack gives each worker a free port)."""
    worker_metrics_host: str = "127.0.0.1"
    heartbeat_interval_s: float = 0.5
    worker_dead_after_s: float = 3.0
    worker_nice: int = 10
    """Niceness of the workers the local stack starts (0: none): their sessions, and the
    vLLM engine each runs (``engine_nice``). In production they have hosts of their own."""
    engine_nice: int = 0
    """Niceness a worker gives the vLLM engine core it starts. The worker's own loop (its
    Kafka I/O, cancels, and vLLM's output processing) keeps the worker's niceness, so
    a busy engine does not starve it."""
    worker_env: dict[str, str] = Field(
        default_factory=lambda: {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    )
    """Environment added to workers the local stack starts (irrelevant on GPU workers).

    vLLM-CPU's default binding (``auto``) pins each engine's compute process to core 0
    and reserves the rest. Several engines on one small host then share that core, and
    a restarting one imports torch at a few percent of it (seen: 3 s of CPU in 104 s,
    and 6 to 8 minutes to restart). Unbound, with one compute thread each (as ``auto``
    gave them), the OS spreads the engines over the cores."""
    worker_python: Path | None = None
    """Interpreter of the worker environment, used by ``tokenbus up`` and the tests."""

    # -- billing ----------------------------------------------------------------------
    clickhouse_dsn: str | None = None
    """``chdb:///dir`` (embedded), ``chdb://memory`` or ``http://user:pass@host:8123/db``."""
    billing_batch_rows: int = 50_000
    """A batch closes at this many records or ``billing_batch_interval_s`` after its first,
    whichever comes first. Each insert cost chdb a fixed ~25 to 30 ms of CPU on a
    development machine (a new part, its rollups, its fsync), and each part is merged
    again later, so under load fewer, larger batches are cheaper; under light load the
    interval closes them, so this bounds a batch's size, not its wait."""
    billing_batch_interval_s: float = 1.0
    billing_insert_gap_s: float = Field(default=5.0, ge=0.0, le=600.0)
    """While usage keeps coming, the least time from one batch's close to the next's: a
    steady trickle is inserted every this often, not every ``billing_batch_interval_s``.
    Each insert costs chdb a fixed 25 to 30 ms of CPU (``billing_batch_rows``), taken
    from the cores the engine shares on a small host, and ClickHouse advises about one
    insert a second at most (its own Kafka engine flushes every 7.5 s). A batch whose
    first record comes after a quiet spell still closes ``billing_batch_interval_s``
    after it, so an occasional request is in ClickHouse within about that, and one that
    reaches ``billing_batch_rows`` closes at once. 0: the interval alone."""
    billing_query_port: int = 18123
    """Loopback port where the sink answers SQL for the chdb data it owns."""
    billing_batch_max_rows: int = 50_000
    """Under a backlog a batch takes what is already fetched, up to this many rows."""
    billing_recent_attempts: int = 500_000
    """Attempts the sink remembers (as hashes) to skip asking ClickHouse about new ones."""
    billing_recent_window_s: float = Field(default=900.0, gt=0)
    """At an assignment the sink reads back the attempts created this long before the
    newest stored one; older ones it looks up in ClickHouse when they come again. Above
    ``billing_copy_skew_s``, so that new attempts need no lookup once the sink starts."""
    billing_copy_skew_s: float = Field(default=600.0, ge=0)
    """How far apart the copies of one attempt may have been created: a request the Faust
    job admits again after a crash that lost its ledger entry runs again under the same
    key, created at its second admission. The sink looks up in ClickHouse every attempt
    created less than this after the oldest it remembers (``billing.recent``), so such a
    pair is billed once if their admissions are at most this far apart."""
    billing_prices_file: Path | None = None
    """TOML price table (see ``tokenbus/prices.toml``); unset: that bundled file."""
    billing_heap_reserve_mb: int = Field(default=128, ge=0)
    """MiB of heap the usage sink faults in at start and keeps for its life, so that each
    batch reuses memory instead of faulting in fresh pages the kernel must clear
    (tokenbus.heap_reserve). 0: none."""

    # -- cost weights (tokenbus.cost; shared by the quota and billing) ------------------
    peak_hours: str = ""
    """Hours in which work costs 1.5x, e.g. ``"9-17"`` or ``"8-12,14-18"``; empty: none."""
    peak_hours_tz: str = "UTC"
    """The time zone ``peak_hours`` are read in."""

    # -- spend budgets (stream_jobs.budgets; budgets sit in the tenants file) -------------
    budgets_read_timeout_s: float = 15.0
    """A starting job admits once it has read the budgets topic to its end, or after
    this long (logging where it stood): a topic that never reaches its end offset must
    not stop admission."""
    budget_tz: str = "UTC"
    """The zone of calendar budget periods (day, week, month) that name none."""
    admin_key: str | None = None
    """The key of the bridge's admin API (``/admin/budgets``). Never a tenant's key.
    Unset: the admin API answers 404."""
    budget_webhook_url: str | None = None
    """Where ``python -m billing.alerts`` posts budget alerts; unset: alerts stay on the topic."""
    budget_webhook_secret: str | None = None
    """Signs each alert's body (``X-Tokenbus-Signature: sha256=<HMAC-SHA256 hex>``)."""
    budget_webhook_max_backoff_s: float = 30.0
    """A failing webhook is retried with doubling waits up to this, until it answers."""
    alerts_port: int = 18125
    """``python -m billing.alerts`` serves ``/healthz`` and ``/metrics`` (reconciliation drift)."""
    budget_reconcile_interval_s: float = 86400.0
    """How often ``python -m billing.alerts`` reconciles the job's spend with ClickHouse (first
    run one interval after its start); 0: never."""
    budget_reconcile_settle_s: float = 5.0
    """A bucket that drifts is read again after this, and reported only if it still does."""
    clock_offset_file: Path | None = None
    """Tests only: seconds read from this file are added to the job's wall clock
    (``tokenbus.clock.OffsetClock``): admission time, quota windows, budget periods and
    prices all move together; workers' heartbeats look that much older meanwhile."""

    # -- clients ------------------------------------------------------------------------
    client_quiet_s: float = 5.0
    """A stream that hears nothing this long reads its reply topic back from the
    request's start, in case the reply reader missed records (then it says so in the
    log); the wait doubles after each read-back. 0: never."""
    client_timeout_s: float = 120.0
    """A client gives up on a request with no chunk for this long: it never hangs."""

    # -- bridge (OpenAI-compatible HTTP + SSE) -------------------------------------------
    bridge_host: str = "127.0.0.1"
    bridge_port: int = 18080
    bridge_max_body_bytes: int = 1_048_576
    bridge_body_read_timeout_s: float = 10.0
    """The whole body must arrive within this, from the end of the headers: a body that
    trickles in (a byte at a time, or half of it and then nothing) is answered 408 and
    its connection closed."""
    bridge_models: list[str] = []
    """Models the bridge knows besides ``served_model_name`` and those live workers serve:
    a request for one of them that no worker serves is a 503, any other model a 404."""
    bridge_max_prompt_chars: int = 262_144
    """Checked before tokenizing, so a huge prompt costs no tokenizer time."""
    bridge_key_rate_per_s: float = 100.0
    """Requests per second one API key or token may send; more are answered 429."""
    bridge_key_burst: int = 100
    bridge_heartbeat_s: float = 15.0
    """An SSE comment is sent when a stream has been quiet this long."""
    bridge_first_chunk_wait_s: float = 10.0
    """A stream's HTTP status waits this long for the first chunk, so rejections get 429/503."""
    bridge_session_secret: str | None = None
    """Signs session IDs to their tenant; share it across bridge instances. Unset: random."""
    bridge_injection_patterns: list[str] | None = None
    """Regexes for prompt injection (case-insensitive); unset: bridge.hygiene's defaults."""
    bridge_sensitive_patterns: list[str] | None = None
    """Regexes for sensitive data (keys, card numbers); unset: bridge.hygiene's defaults."""

    # -- batch jobs (batches/) ------------------------------------------------------------
    batch_store_url: str | None = None
    """Where input, output and error files and batches' status documents live, as an
    fsspec URL: a directory, or ``s3://bucket/prefix`` (with s3fs installed) shared by
    the bridges and runners of a cluster. Unset: ``<home>/batches``."""
    batch_port: int = 18126
    """``python -m batches`` serves ``/healthz`` and ``/metrics`` (per-batch progress)."""
    batch_max_file_bytes: int = 200 * 1024 * 1024
    """The largest input file ``POST /v1/files`` accepts (OpenAI's limit). An upload is
    answered 413 as soon as its body passes it (and the form's framing), read or not."""
    batch_upload_timeout_s: float = 300.0
    """A ``POST /v1/files`` body must arrive whole within this (408, connection closed),
    as JSON bodies within ``bridge_body_read_timeout_s``: longer, since a file may be
    ``batch_max_file_bytes``."""
    batch_create_max_inflight_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    """The bytes of input files one bridge checks for ``POST /v1/batches`` at once, all
    tenants' creates together (a tenant has one at a time); a create beyond it is
    answered 429 ``batch_create_busy`` with ``Retry-After``, so a few tenants' large
    batches cannot take the bridge that serves everyone's interactive requests. A
    create reads its file a line at a time (memory for its longest line, not its size),
    but holds a thread and CPU the interactive requests share for as long as its lines
    take to check. A file larger than this is let in alone. 0: no limit."""
    batch_max_lines: int = 50_000
    """The most lines one batch may hold (OpenAI's limit)."""
    batch_min_window_s: float = 10.0
    batch_max_window_s: float = 7 * 86400.0
    """The ``completion_window`` a batch may ask for: OpenAI's ``24h``, or e.g. ``30m``."""
    batch_expiry_grace_s: float = 30.0
    """At expiry the running lines are aborted; their last chunks are awaited this long."""
    batch_status_interval_s: float = 1.0
    """How often a running batch's status document is rewritten."""

    # -- derived ------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return self.kafka_bootstrap or f"{self.kafka_host}:{self.kafka_port}"

    @property
    def idempotent_producers(self) -> bool:
        if self.kafka_idempotence is not None:
            return self.kafka_idempotence
        return self.broker_profile == "kafka"

    @property
    def batch_metrics(self) -> str:
        return self.batch_metrics_url or f"http://127.0.0.1:{self.batch_port}/metrics"

    @property
    def job_metrics(self) -> str | None:
        if self.job_metrics_url is not None:
            return self.job_metrics_url
        if self.faust_web_port is None:
            return None
        return f"http://127.0.0.1:{self.faust_web_port}/metrics"

    @property
    def faust_dir(self) -> Path:
        return self.faust_datadir or self.home / "faust"

    @property
    def model_dir(self) -> Path:
        return self.model_path or self.home / "models" / self.served_model_name

    def authenticator(self) -> Authenticator:
        """The one credential check, as the bridge and the job both make it."""
        from tokenbus.auth import Authenticator  # PyJWT: the stream environment only

        return Authenticator(
            self.tenant_directory(),
            Topics(self.topic_prefix),
            audience=self.jwt_audience,
            hs256_secret=self.jwt_hs256_secret,
            rs256_public_key=self.jwt_rs256_public_key,
            service_secret=self.bus_service_secret,
            allow_unlisted_tenants=self.allow_unlisted_tenants,
            leeway_s=self.jwt_leeway_s,
        )

    @property
    def batch_store(self) -> str:
        return self.batch_store_url or str(self.home / "batches")

    @property
    def batch_topic_retention_ms(self) -> int:
        """``retention.ms`` of the batches topic and of each batch's reply topic: the
        longest completion window and a day, so a batch's records outlive it
        (``tokenbus.topics.TopicPlan``)."""
        return int((self.batch_max_window_s + 86_400) * 1000)

    @property
    def clickhouse(self) -> str:
        return self.clickhouse_dsn or f"chdb://{self.home / 'clickhouse'}"

    @property
    def consumer_fetch_wait_ms(self) -> int:
        """``fetch_max_wait_ms``, or its default for the broker profile."""
        if self.fetch_max_wait_ms is not None:
            return self.fetch_max_wait_ms
        return 500 if self.broker_profile == "kafka" else 20

    @property
    def reply_topic_records(self) -> int | None:
        """``reply_topic_roll_records``, or its default for the broker profile; None:
        a client keeps one reply topic."""
        records = self.reply_topic_roll_records
        if records is None:
            records = 1_000 if self.broker_profile == "tansu" else 0
        return records or None

    @property
    def background_fetch_wait_ms(self) -> int:
        """``background_fetch_max_wait_ms``, or its default for the broker profile."""
        if self.background_fetch_max_wait_ms is not None:
            wait_ms = self.background_fetch_max_wait_ms
        else:
            wait_ms = 500 if self.broker_profile == "kafka" else 100
        return max(wait_ms, self.consumer_fetch_wait_ms)

    @property
    def served_precision(self) -> str:
        short = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
        return self.precision or short.get(self.dtype, self.dtype)

    def tenant_directory(self) -> TenantDirectory:
        """All tenants: the file's, with ``tenant_tpm`` overrides, else the defaults."""
        default = TenantConfig(
            tenant_id="*",
            tpm=self.default_tpm,
            rpm=self.default_rpm,
            burst_s=self.default_burst_s,
            priority_class=self.default_priority_class,
        )
        if self.tenants_file is not None:
            directory = TenantDirectory.from_file(self.tenants_file, default)
        else:
            directory = TenantDirectory({}, default)
        return directory.with_overrides(
            {tenant: {"tpm": tpm} for tenant, tpm in self.tenant_tpm.items()}
        )


def settings_problem(exc: ValidationError) -> str:
    """A ``Settings`` validation error, one line a setting, each named as an operator
    sets it (``TOKENBUS_<FIELD>``). The value is left out: it may be a secret."""
    lines = [
        "TOKENBUS_" + "__".join(str(part) for part in error["loc"]).upper() + ": " + error["msg"]
        for error in exc.errors()
    ]
    return "invalid settings:\n  " + "\n  ".join(lines)
