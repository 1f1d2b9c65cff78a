-- Recent budget alerts
-- The budget alerts fired in the window, newest first, at most `limit` per tenant: which
-- budget, the threshold reached (a hard budget's first refusal is its 100%), and the
-- spend against the limit when it fired. One row per alert (the sink writes each once).
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  first instant counted (UTC)
-- @param until = "2100-01-01 00:00:00"  first instant not counted (UTC)
-- @param limit = 20  alerts per tenant
SELECT
    tenant_id,
    fired_at,
    budget_id,
    entity,
    threshold,
    reason,
    enforce,
    spent_units,
    limit_units,
    period_start,
    period_end
FROM budget_alerts
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND fired_at >= {since:DateTime64(3, 'UTC')}
  AND fired_at < {until:DateTime64(3, 'UTC')}
ORDER BY tenant_id, fired_at DESC, alert_id
LIMIT {limit:UInt32} BY tenant_id
