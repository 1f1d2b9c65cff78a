-- Budget against actual
-- Billed cost units per budget period (calendar day, Monday week or month in a zone) of
-- one tenant, one model, or the pair, against a budget's limit: what the job's budget
-- counts, to the last digit (the reconciliation compares the two).
-- @param tenant = ""  one tenant, or every tenant when empty
-- @param since = "1970-01-01 00:00:00"  first instant counted (UTC)
-- @param until = "2100-01-01 00:00:00"  first instant not counted (UTC)
-- @param model = ""  one model, or every model when empty
-- @param period = "month"  day, week or month
-- @param tz = "UTC"  the budget's time zone
-- @param budget = "0"  the budget's limit, in cost units
WITH toDate(toTimeZone(created_at, {tz:String})) AS local_day
SELECT
    multiIf(
        {period:String} = 'day', local_day,
        {period:String} = 'week', toMonday(local_day),
        toStartOfMonth(local_day)
    ) AS period_start,
    sum(billed_units) AS billed_units,
    {budget:Decimal(38, 9)} AS budget_units,
    budget_units - billed_units AS remaining_units,
    count() AS num_attempts
FROM usage_events
WHERE ({tenant:String} = '' OR tenant_id = {tenant:String})
  AND ({model:String} = '' OR model = {model:String})
  AND created_at >= {since:DateTime64(3, 'UTC')}
  AND created_at < {until:DateTime64(3, 'UTC')}
GROUP BY period_start
ORDER BY period_start
