-- The credential behind each attempt, so key budgets reconcile like the others.
--
-- key_sha256 is the SHA-256 the job charged the request's key budgets to: an API key's
-- (as the tenants file lists it), or a token's that carries its own balance; '' when
-- neither. It comes from the WorkItem, through the UsageEvent, never from a producer.
-- Rows written before this migration read ''. The column is not in the sort key: an
-- attempt's identity does not change, and the reconciliation reads one tenant's rows
-- (tenant first) before it filters by key.
ALTER TABLE usage_events
    ADD COLUMN IF NOT EXISTS key_sha256 String DEFAULT '' AFTER price_version;
