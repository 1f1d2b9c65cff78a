-- Top sessions by cost
-- The sessions with the highest billed cost among those active in the window (a request
-- created before `until` and one finished at or after `since`), with their whole cost.
-- Answered from the per-session rollup (the projection usage_by_session), without FINAL.
-- Ties go to tenant, then session, so the order is stable.
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  sessions still active at this instant (UTC)
-- @param until = "2100-01-01 00:00:00"  sessions begun before this instant (UTC)
-- @param limit = 20  how many sessions
SELECT
    tenant_id,
    session_id,
    -- @include attempt_totals
FROM usage_events
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
GROUP BY tenant_id, session_id
HAVING first_created_at < {until:DateTime64(3, 'UTC')}
   AND last_finished_at >= {since:DateTime64(3, 'UTC')}
ORDER BY billed_units DESC, tenant_id, session_id
LIMIT {limit:UInt32}
