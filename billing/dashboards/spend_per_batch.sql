-- Spend per batch
-- Billed and list-price cost units, attempts, failed attempts and tokens of each batch job
-- (requests with a batch_id, priced at the batch multiplier), per tenant, for the lines
-- created in the window; costliest first. Reads usage_events with FINAL, exact even for a
-- copy the sink could not keep out (see billing/sink.py).
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  lines created from this instant (UTC)
-- @param until = "2100-01-01 00:00:00"  lines created before this instant (UTC)
-- @param limit = 50  batches shown
SELECT
    tenant_id,
    batch_id,
    -- @include attempt_totals
FROM usage_events FINAL
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND batch_id != ''
  AND created_at >= {since:DateTime64(3, 'UTC')}
  AND created_at < {until:DateTime64(3, 'UTC')}
GROUP BY tenant_id, batch_id
ORDER BY billed_units DESC, tenant_id, batch_id
LIMIT {limit:UInt32}
