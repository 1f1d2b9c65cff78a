-- A min-max index of created_at, for the billing sink's read of its recent attempts.
--
-- The sink reads back the attempts created in the last minutes (billing.recent) each time
-- partitions are assigned to it. The sort key leads with the tenant, so without this
-- index that read scans the created_at column of the whole month's partition; with it,
-- ClickHouse skips the granules created earlier (rows arrive roughly in created_at
-- order). Parts written before this migration have no index and are read in full.
ALTER TABLE usage_events
    ADD INDEX IF NOT EXISTS created_at_minmax created_at TYPE minmax GRANULARITY 1;
