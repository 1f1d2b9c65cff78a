"""The one configuration model: every service reads its settings from here.

Values come from ``TOKENBUS_*`` environment variables (nested fields use ``__``), and
tests override them through the constructor. Nothing reads the environment at import.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_home() -> Path:
    return Path.cwd() / ".tokenbus"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENBUS_", env_nested_delimiter="__")

    # -- where things live --------------------------------------------------------
    home: Path = Field(default_factory=_default_home)
    """State of the local stack: broker port, model cache, ClickHouse data, pid file."""

    # -- Kafka ----------------------------------------------------------------------
    kafka_bootstrap: str | None = None
    """``host:port[,host:port]``. Unset: ``tokenbus up`` starts the bundled tansu broker."""
    kafka_port: int = 19092
    """Port of the bundled broker when ``kafka_bootstrap`` is unset."""
    topic_prefix: str = "tokenbus"
    num_partitions: int = 4
    """Partitions of the request and usage topics; the unit of scale-out."""
    replication_factor: int = 1
    kafka_acks: int | str = "all"
    kafka_idempotence: bool = False
    """Idempotent producers need InitProducerId, which the bundled broker lacks."""
    linger_ms: int = 0
    fetch_max_wait_ms: int = 5
    """aiokafka's default 500 ms would dominate every hop on a quiet topic."""
    request_timeout_ms: int = 30_000

    # -- Faust job ------------------------------------------------------------------
    faust_app_id: str = "tokenbus-dispatch"
    faust_session_timeout_s: float = 4.0
    faust_rebalance_timeout_s: float = 4.0
    faust_heartbeat_interval_s: float = 1.0
    faust_commit_interval_s: float = 1.0
    """How often Faust commits acked offsets; a crash redelivers at most this much."""

    # -- admission (simple per-minute token quota; issue 3 replaces it) --------------
    default_tpm: int = 1_000_000
    tenant_tpm: dict[str, int] = Field(default_factory=dict)
    """Per-tenant tokens-per-minute overrides, e.g. ``{"acme": 20000}``."""

    # -- workers ----------------------------------------------------------------------
    worker_id: str = "worker-0"
    model_path: Path | None = None
    """A Hugging Face model directory. Unset: the tiny model built into ``home``."""
    served_model_name: str = "tiny-llama"
    max_num_seqs: int = 64
    max_model_len: int = 16_384
    kv_cache_gib: int = 1
    dtype: str = "float32"
    precision: str | None = None
    """What billing calls the served weights (``int8`` for a quantized model); default: dtype."""
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    heartbeat_interval_s: float = 0.5
    worker_dead_after_s: float = 3.0
    worker_python: Path | None = None
    """Interpreter of the worker environment, used by ``tokenbus up`` and the tests."""

    # -- billing ----------------------------------------------------------------------
    clickhouse_dsn: str | None = None
    """``chdb:///dir`` (embedded), ``chdb://memory`` or ``http://user:pass@host:8123/db``."""
    billing_batch_rows: int = 1_000
    billing_batch_interval_s: float = 1.0
    billing_query_port: int = 18123
    """Loopback port where the sink answers SQL for the chdb data it owns."""

    # -- clients ------------------------------------------------------------------------
    client_timeout_s: float = 120.0
    """A client gives up on a request with no chunk for this long: it never hangs."""

    # -- derived ------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return self.kafka_bootstrap or f"127.0.0.1:{self.kafka_port}"

    @property
    def model_dir(self) -> Path:
        return self.model_path or self.home / "models" / self.served_model_name

    @property
    def clickhouse(self) -> str:
        return self.clickhouse_dsn or f"chdb://{self.home / 'clickhouse'}"

    @property
    def served_precision(self) -> str:
        short = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
        return self.precision or short.get(self.dtype, self.dtype)

    def tpm_for(self, tenant_id: str) -> int:
        return self.tenant_tpm.get(tenant_id, self.default_tpm)
