"""The alerts service, billing's outward side (``python -m billing.alerts``).

# budget-alerts --> webhook (a signed POST per alert)
# job /budgets + billed usage (``billing.reader``) --> reconcile --> drift in the log, /metrics

Part of billing: the budget alerts it sends are the ones ``billing.alert_sink`` lands in
ClickHouse, and its reconciliation checks the job's spend against billing's own rows.
"""
