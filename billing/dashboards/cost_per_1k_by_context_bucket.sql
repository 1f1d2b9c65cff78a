-- Cost per 1k tokens by context-length bucket
-- List-price cost per 1,000 tokens (prompt + completion) of the attempts whose prompt
-- falls in each bucket of `bucket_tokens`: what long context really costs. Rejected
-- attempts never ran and are left out. Reads usage_events with FINAL, exact even for a
-- copy the sink could not keep out (see billing/sink.py).
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  requests created from this instant (UTC)
-- @param until = "2100-01-01 00:00:00"  requests created before this instant (UTC)
-- @param bucket_tokens = 2048  width of a bucket, in prompt tokens
SELECT
    intDiv(prompt_tokens, {bucket_tokens:UInt32}) * {bucket_tokens:UInt32} AS context_from,
    context_from + {bucket_tokens:UInt32} AS context_to,
    count() AS num_attempts,
    sum(prompt_tokens) + sum(completion_tokens) AS tokens,
    sum(cost_units) AS cost_units,
    if(tokens = 0, 0, toFloat64(cost_units) * 1000 / tokens) AS cost_per_1k_tokens,
    avg(cost_weight) AS mean_cost_weight
FROM usage_events FINAL
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND created_at >= {since:DateTime64(3, 'UTC')}
  AND created_at < {until:DateTime64(3, 'UTC')}
  AND status != 'rejected'
GROUP BY context_from
ORDER BY context_from
