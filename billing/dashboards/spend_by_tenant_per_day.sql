-- Spend by tenant per day
-- Billed and list-price cost units, attempts and tokens, per tenant and UTC day of the
-- requests' creation. Answered from the tenant x model x minute rollup (the projection
-- usage_by_minute), which holds each attempt once, so it needs no FINAL.
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  first minute counted (UTC)
-- @param until = "2100-01-01 00:00:00"  first minute not counted (UTC)
SELECT
    tenant_id,
    toDate(toStartOfMinute(created_at)) AS day,
    sum(billed_units) AS billed_units,
    sum(cost_units) AS cost_units,
    count() AS num_attempts,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens
FROM usage_events
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND toStartOfMinute(created_at) >= {since:DateTime64(3, 'UTC')}
  AND toStartOfMinute(created_at) < {until:DateTime64(3, 'UTC')}
GROUP BY tenant_id, day
ORDER BY tenant_id, day
