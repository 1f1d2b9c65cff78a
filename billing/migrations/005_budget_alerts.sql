-- One row per budget alert (schemas.budgets.BudgetAlert), for the dashboard.
--
-- The billing sink reads the budget-alerts topic as it reads usage (billing.alert_sink):
-- it leaves out alert ids the table already holds and inserts the rest as one block with
-- an insert_deduplication_token, then commits. So each alert is one row, read without
-- FINAL, like usage rows. The key is the alert's identity, tenant first; an alert id
-- (budget|bucket|threshold) fires once per entity and period, and a model budget's alert
-- names the tenant whose request reached it. The partition derives from fired_at, which
-- a redelivered copy shares.
CREATE TABLE IF NOT EXISTS budget_alerts
(
    tenant_id     String,
    alert_id      String,
    budget_id     String,
    entity        String,
    period_start  DateTime64(3, 'UTC'),
    period_end    DateTime64(3, 'UTC'),
    threshold     UInt8,
    limit_units   Decimal(38, 9),
    spent_units   Decimal(38, 9),
    enforce       LowCardinality(String),
    reason        LowCardinality(String),
    fired_at      DateTime64(3, 'UTC'),
    inserted_at   DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(inserted_at)
PARTITION BY toYYYYMM(fired_at)
ORDER BY (tenant_id, alert_id)
SETTINGS non_replicated_deduplication_window = 1000, fsync_after_insert = 1;
