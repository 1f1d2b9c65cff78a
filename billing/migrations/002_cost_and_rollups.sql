-- Cost per attempt, the price table, and rollups that stay exact without FINAL.
--
-- The rollups are aggregate projections of usage_events: ClickHouse stores each one
-- inside the data part it summarizes, so a part and its rollup rows appear together or
-- not at all, even when the sink is killed in the middle of an insert. (Materialized
-- views write separate parts after the table's own, and a kill in between left an
-- attempt in the table but not in the view, where no later insert could add it.)
--
-- Why they need no FINAL: the sink inserts only attempts that are not in usage_events
-- yet (billing.sink), so each attempt is in exactly one part. Queries read them with
-- plain GROUP BY over usage_events, and ClickHouse answers from a projection whenever
-- the query's keys and aggregates are among the projection's (see billing/dashboards;
-- tests run those with force_optimize_projection). A retried insert carries the same
-- insert_deduplication_token, which non-replicated tables remember only with
-- non_replicated_deduplication_window set. ReplacingMergeTree merges rebuild the
-- projections of the parts they rewrite (deduplicate_merge_projection_mode, which a
-- ClickHouse server has from 24.8).
--
-- The sink commits Kafka offsets once an insert returns, so an insert must outlive the
-- machine, not just the process: the table fsyncs its new parts.
--
-- Minutes bucket by created_at, the instant that also picks the price version and the
-- peak-hour weight, so a minute's cost never moves once its requests are in.

ALTER TABLE usage_events
    ADD COLUMN IF NOT EXISTS overload_tier UInt8 DEFAULT 0 AFTER error_code,
    ADD COLUMN IF NOT EXISTS precision LowCardinality(String) DEFAULT '' AFTER overload_tier,
    ADD COLUMN IF NOT EXISTS flags Array(LowCardinality(String)) AFTER precision,
    ADD COLUMN IF NOT EXISTS cost_weight Float64 DEFAULT 0 AFTER flags,
    ADD COLUMN IF NOT EXISTS cost_units Decimal(38, 9) DEFAULT 0 AFTER cost_weight,
    ADD COLUMN IF NOT EXISTS billed_units Decimal(38, 9) DEFAULT 0 AFTER cost_units,
    ADD COLUMN IF NOT EXISTS price_version UInt32 DEFAULT 0 AFTER billed_units;

ALTER TABLE usage_events MODIFY SETTING
    non_replicated_deduplication_window = 1000,
    fsync_after_insert = 1,
    fsync_part_directory = 1,
    deduplicate_merge_projection_mode = 'rebuild';

-- tenant x model x minute x status.
ALTER TABLE usage_events ADD PROJECTION IF NOT EXISTS usage_by_minute
(
    SELECT
        tenant_id,
        model,
        toStartOfMinute(created_at),
        status,
        count(),
        sum(prompt_tokens),
        sum(completion_tokens),
        sum(cached_tokens),
        sum(cost_units),
        sum(billed_units)
    GROUP BY tenant_id, model, toStartOfMinute(created_at), status
);

-- One row per session.
ALTER TABLE usage_events ADD PROJECTION IF NOT EXISTS usage_by_session
(
    SELECT
        tenant_id,
        session_id,
        count(),
        countIf(status = 'failed'),
        sum(prompt_tokens),
        sum(completion_tokens),
        sum(cached_tokens),
        sum(cost_units),
        sum(billed_units),
        min(created_at),
        max(finished_at)
    GROUP BY tenant_id, session_id
);

-- Rows written under version 001 (which read them with FINAL): merging collapses their
-- copies and writes the new parts with both projections.
OPTIMIZE TABLE usage_events FINAL;

-- One row per (model, version); the sink copies the price file here at start. Prices
-- belong to no tenant, so there is no tenant column to lead the key.
CREATE TABLE IF NOT EXISTS prices
(
    model               LowCardinality(String),
    version             UInt32,
    effective_from      DateTime64(3, 'UTC'),
    input_per_1k        Decimal(38, 9),
    output_per_1k       Decimal(38, 9),
    cached_input_per_1k Decimal(38, 9),
    loaded_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(loaded_at)
ORDER BY (model, version);
