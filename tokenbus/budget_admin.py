"""Runtime budget changes: one record on the compacted budgets topic per change.

# BudgetConfig --> key budget_id, value its JSON (or empty: removed) --> tokenbus.budgets
# every job instance reads the topic from its start (stream_jobs.app) --> its BudgetBook

Written by the bridge's admin API and ``tokenbus budget set``; a change binds from the
next request each job instance admits after reading it. The job's spend is kept per
budget id: changing a budget's limit keeps its spend this period.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from tokenbus.budget_config import BudgetConfig
from tokenbus.config import Settings
from tokenbus.kafka import make_producer
from tokenbus.topics import Topics


def budget_record(config: BudgetConfig, default_tz: str) -> tuple[bytes, bytes]:
    return config.budget_id(default_tz).encode(), config.model_dump_json().encode()


async def publish_budget_change(settings: Settings, key: bytes, value: bytes | None) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(Topics(settings.topic_prefix).budgets, value, key=key)
    finally:
        await producer.stop()


def job_budgets(settings: Settings, timeout_s: float = 5.0) -> dict[str, Any]:
    """The job's view (``/budgets`` on its web port): each budget's spend this period,
    and settled spend per bucket."""
    if settings.faust_web_port is None:
        raise RuntimeError("the job serves /budgets only with TOKENBUS_FAUST_WEB_PORT set")
    url = f"http://127.0.0.1:{settings.faust_web_port}/budgets"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data: dict[str, Any] = json.loads(response.read())
    return data
