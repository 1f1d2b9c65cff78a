-- The batch job each attempt was a line of: '' for a request outside any batch.
--
-- batch_id comes from the WorkItem, through the UsageEvent (the job admits a batch_id at
-- class 2 only). It prices the attempt at the batch multiplier (tokenbus/prices.toml
-- [batch]) and groups spend per batch (billing/dashboards/spend_per_batch.sql). Rows
-- written before this migration read ''. A plain String with an empty default, like
-- key_sha256: interactive rows carry '' at next to no cost. It is not in the sort key:
-- spend per batch reads one tenant's rows (tenant first) and groups them.
ALTER TABLE usage_events
    ADD COLUMN IF NOT EXISTS batch_id String DEFAULT '' AFTER key_sha256;
