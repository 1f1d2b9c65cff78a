-- Spend by adapter
-- Billed and list-price cost units, attempts and tokens per tenant, base model and LoRA
-- adapter ('' is the base model alone), for the requests created in the window. Reads
-- usage_events with FINAL, exact even for a copy the sink could not keep out (see
-- billing/sink.py).
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  requests created from this instant (UTC)
-- @param until = "2100-01-01 00:00:00"  requests created before this instant (UTC)
SELECT
    tenant_id,
    model,
    adapter,
    sum(billed_units) AS billed_units,
    sum(cost_units) AS cost_units,
    count() AS num_attempts,
    sum(prompt_tokens) AS prompt_tokens,
    sum(completion_tokens) AS completion_tokens
FROM usage_events FINAL
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND created_at >= {since:DateTime64(3, 'UTC')}
  AND created_at < {until:DateTime64(3, 'UTC')}
GROUP BY tenant_id, model, adapter
ORDER BY tenant_id, billed_units DESC, model, adapter
