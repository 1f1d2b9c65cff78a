"""Billing: the usage topic lands in ClickHouse, and reports read it back.

Layers, each its own module, imports flowing one way:
``storage`` (the contract and its ClickHouse implementation) <-- ``sink`` (Kafka -->
storage) and ``query_server`` (loopback SQL for the data the sink's process owns)
<-- ``reader`` (how another process reaches that data) <-- ``report`` / ``console``.
"""
