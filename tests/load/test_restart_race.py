"""The job restarted while its offset lookups are slow: a reproducer of record losses in
Faust's recovery (``make restart-race``, kept out of ``make test``: it adds a restart).

Faust seeks the stream partitions to their committed offsets once it has recovered its
tables, one offset lookup per partition, and records fetched around then must reach the
agents. ``stream_jobs.faust_recovery`` closes the two windows in which they did not: the
agents' queues emptied after the seek (with Faust's own order the job took none of the
requests waiting for it), and a fetch begun while the tables recovered that drained the
request partitions once Faust's set of active partitions had emptied (aiokafka drains
every partition for an empty set; ``tests/integration/test_faust_intake.py``). Before
the second fix, full test runs on the bundled broker lost the 100 requests waiting for
the restarted job, here and in
``test_quotas::test_restarting_the_job_mid_window_loses_no_count_and_no_request``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from producers import TokenbusClient
from tests.integration.test_quotas import PROMPT, SHORT, run
from tokenbus_cli.stack import Stack

SLOW_OFFSET_LOOKUPS = """
import asyncio, aiokafka
_committed = aiokafka.AIOKafkaConsumer.committed
async def committed(self, partition):
    await asyncio.sleep(0.06)  # a loaded broker: the job's seek after recovery is slow
    return await _committed(self, partition)
aiokafka.AIOKafkaConsumer.committed = committed
"""


async def test_a_job_restarted_while_offset_lookups_are_slow_loses_no_request(
    client: TokenbusClient, stack: Stack, tmp_path: Path
) -> None:
    """Faust seeks the stream partitions to their committed offsets once it has recovered
    its tables, one offset lookup per partition. Records fetched meanwhile must reach
    the agents (stream_jobs.faust_recovery): with Faust's own order they were emptied
    from the agents' queues, and the job took none of the requests waiting for it."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_OFFSET_LOOKUPS)
    job = stack.service("stream_job")
    plain = dict(job.env)
    job.env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tmp_path), plain.get("PYTHONPATH")) if p
    )
    try:
        restart = asyncio.create_task(stack.restart("stream_job"))
        await asyncio.sleep(0.2)  # the job is down: these wait in Kafka
        waiting = [
            await client.submit(tenant_id="restart-slow", prompt=PROMPT, sampling=SHORT)
            for _ in range(100)
        ]
        await restart
        results = await asyncio.wait_for(
            asyncio.gather(*(run(client, r) for r in waiting)), timeout=50
        )
        assert [chunks[-1].error for chunks in results] == [None] * 100
    finally:
        job.env.clear()
        job.env.update(plain)
        await stack.restart("stream_job")
