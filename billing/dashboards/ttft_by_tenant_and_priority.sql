-- p50 and p99 TTFT by tenant and priority
-- Time to first token, from the request's creation, of the attempts that produced a
-- token, per tenant and priority class (0 VIP, 1 standard, 2 batch). Exact quantiles,
-- interpolated between ranks (quantileExactInclusive). Reads usage_events with FINAL.
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  requests created from this instant (UTC)
-- @param until = "2100-01-01 00:00:00"  requests created before this instant (UTC)
SELECT
    tenant_id,
    priority,
    count() AS num_attempts,
    quantileExactInclusive(0.5)(ttft_ms) AS p50_ttft_ms,
    quantileExactInclusive(0.99)(ttft_ms) AS p99_ttft_ms
FROM usage_events FINAL
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND created_at >= {since:DateTime64(3, 'UTC')}
  AND created_at < {until:DateTime64(3, 'UTC')}
  AND ttft_ms IS NOT NULL
GROUP BY tenant_id, priority
ORDER BY tenant_id, priority
