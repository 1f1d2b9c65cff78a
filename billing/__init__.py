"""Billing: the usage topic lands in ClickHouse, priced, each attempt once; reports read it.

Layers, each its own module, imports flowing one way:

- pure policies: ``dedup`` (which events are new attempts, insert tokens),
  ``rows`` (event + charge --> row), ``queries`` (the dashboard SQL files), ``svg`` and
  ``html`` (the dashboard page), ``grafana`` (the Grafana JSON);
- ``storage`` (the contract and its ClickHouse implementation, with ``migrate``)
  <-- ``sink`` (Kafka --> storage) and ``query_server`` (loopback SQL and the dashboard
  for the data the sink's process owns) <-- ``reader`` (how another process reaches that
  data) <-- ``report`` / ``console`` (the CLI's tables);
- prices come from ``tokenbus.pricing`` (price book, charge policy, cost = list price x
  the weight from ``tokenbus.cost``) and ``tokenbus.price_file`` (the TOML table), which
  the job's spend budgets share, so there is one cost model (``bench.billing_ingest``
  measures ingest throughput);
- ``alerts`` (its own process, ``python -m billing.alerts``): budget alerts to a webhook,
  and the reconciliation of the job's spend against billed usage, through ``reader``.
"""
