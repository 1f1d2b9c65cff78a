-- Spans of tokenbus's own trace store (tokenbus.tracing), for `tokenbus trace`.
--
-- Written by the billing process's span sink (billing.span_sink) from the spans topic
-- when no OTLP collector is configured. Tenant first, then the trace: a trace's spans
-- sit together, and a tenant reads only its own. A redelivered batch writes the same
-- (tenant, trace, span) again and ReplacingMergeTree keeps one; readers use FINAL (the
-- table is small beside usage). The request id has a bloom filter, since `tokenbus
-- trace REQUEST_ID` starts there. Spans are kept 7 days.
CREATE TABLE IF NOT EXISTS spans
(
    tenant_id       String,
    trace_id        String,
    span_id         String,
    parent_span_id  String,
    name            LowCardinality(String),
    service         LowCardinality(String),
    start_time      DateTime64(6, 'UTC'),
    duration_us     UInt64,
    status          LowCardinality(String),
    request_id      String,
    attempt         Int32,
    attributes      Map(String, String),
    inserted_at     DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX request_id_bloom request_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(inserted_at)
PARTITION BY toYYYYMMDD(start_time)
ORDER BY (tenant_id, trace_id, span_id)
TTL toDateTime(start_time) + INTERVAL 7 DAY;
