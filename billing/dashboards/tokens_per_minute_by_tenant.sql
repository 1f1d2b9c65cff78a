-- Tokens per minute by tenant
-- Prompt and completion tokens of the requests created in each minute, per tenant
-- (every status; rejected requests have none). Answered from the tenant x model x minute
-- rollup (the projection usage_by_minute), without FINAL.
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  first minute counted (UTC)
-- @param until = "2100-01-01 00:00:00"  first minute not counted (UTC)
SELECT
    tenant_id,
    toStartOfMinute(created_at) AS minute,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens,
    prompt_tokens + completion_tokens AS total_tokens
FROM usage_events
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND minute >= {since:DateTime64(3, 'UTC')}
  AND minute < {until:DateTime64(3, 'UTC')}
GROUP BY tenant_id, minute
ORDER BY tenant_id, minute
