-- Share of failed and cancelled work
-- How much of the work, at list price and in tokens, went to attempts that failed or
-- were cancelled, per tenant and over all of them (tenant "*"). Cost here is what the
-- work consumed (cost_units), whatever the tenant was billed for it. The inner query is
-- answered from the tenant x model x minute rollup (the projection usage_by_minute).
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  first minute counted (UTC)
-- @param until = "2100-01-01 00:00:00"  first minute not counted (UTC)
SELECT
    if(grouping(tenant_id) = 1, '*', tenant_id) AS tenant,
    sum(attempts) AS total_attempts,
    sumIf(attempts, status = 'failed') AS failed_attempts,
    sumIf(attempts, status = 'cancelled') AS cancelled_attempts,
    sum(cost) AS total_cost_units,
    sumIf(cost, status = 'failed') AS failed_cost_units,
    sumIf(cost, status = 'cancelled') AS cancelled_cost_units,
    if(total_cost_units = 0, 0,
       toFloat64(failed_cost_units + cancelled_cost_units) / toFloat64(total_cost_units)) AS cost_share,
    sum(tokens) AS total_tokens,
    sumIf(tokens, status IN ('failed', 'cancelled')) AS failed_cancelled_tokens,
    if(total_tokens = 0, 0, failed_cancelled_tokens / total_tokens) AS token_share
FROM
(
    SELECT
        tenant_id,
        status,
        count() AS attempts,
        sum(cost_units) AS cost,
        sum(prompt_tokens) + sum(completion_tokens) AS tokens
    FROM usage_events
    WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
      AND toStartOfMinute(created_at) >= {since:DateTime64(3, 'UTC')}
      AND toStartOfMinute(created_at) < {until:DateTime64(3, 'UTC')}
    GROUP BY tenant_id, status
)
GROUP BY ROLLUP(tenant_id)
ORDER BY grouping(tenant_id), tenant_id
