-- Totals of a group of attempts (usage rows): billed and list-price cost units, attempts,
-- failed attempts, tokens, and the span from the first creation to the last finish.
-- Each query that shows them has the line `-- @include attempt_totals` in its select
-- list; `python -m billing.queries NAME` prints that query with them in place.
sum(billed_units) AS billed_units,
sum(cost_units) AS cost_units,
count() AS num_attempts,
countIf(status = 'failed') AS num_failed,
sum(prompt_tokens) AS prompt_tokens,
sum(completion_tokens) AS completion_tokens,
min(created_at) AS first_created_at,
max(finished_at) AS last_finished_at
