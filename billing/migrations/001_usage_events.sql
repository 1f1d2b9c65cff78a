-- One row per request attempt, as the workers and the dispatcher emit UsageEvents.
--
-- The sort key is the event's identity, tenant first. Kafka delivers at least once, so
-- the same attempt may be inserted twice; ReplacingMergeTree keeps one row per key after
-- merges, and queries read with FINAL so totals are right before merges run too.
-- The partition key derives from created_at, which a redelivered copy shares, so both
-- copies land in one partition (ReplacingMergeTree only collapses within a partition).
--
-- Absent strings (worker_id, finish_reason, error_code) are stored as '' rather than
-- Nullable: ClickHouse handles empty strings faster and the report groups them the same.
-- ttft_ms stays Nullable because 0 ms and "no first token" mean different things.
CREATE TABLE IF NOT EXISTS usage_events
(
    tenant_id          String,
    session_id         String,
    request_id         String,
    attempt            UInt32,
    model              LowCardinality(String),
    worker_id          LowCardinality(String),
    priority           UInt8,
    status             LowCardinality(String),
    finish_reason      LowCardinality(String),
    prompt_tokens      UInt32,
    completion_tokens  UInt32,
    cached_tokens      UInt32,
    queue_ms           Float64,
    ttft_ms            Nullable(Float64),
    total_ms           Float64,
    error_code         LowCardinality(String),
    created_at         DateTime64(3, 'UTC'),
    finished_at        DateTime64(3, 'UTC'),
    inserted_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(inserted_at)
PARTITION BY toYYYYMM(created_at)
ORDER BY (tenant_id, session_id, request_id, attempt);
