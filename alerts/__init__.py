"""The budget alert sender: ``budget-alerts`` --> a signed HTTP webhook."""
