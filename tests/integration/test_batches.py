"""Batch jobs on the real stack, through the official ``openai`` client and the bridge:
completion with every custom_id once (usage equal to ClickHouse's), a malformed line,
cancel, expiry, and the runner and the job killed mid-batch."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import openai
import pytest
from aiokafka import TopicPartition
from openai.types import Batch

from billing.reader import open_reader
from schemas import SchemaError, UsageEvent, UsageStatus, decode
from tests.integration.conftest import BridgeProcess, bridge_key, eventually, start_bridge
from tokenbus.chunks import decode_batch
from tokenbus.config import Settings
from tokenbus.kafka import delete_topics, ensure_topics, make_consumer, topic_names
from tokenbus.topics import Topics
from tokenbus_cli.stack import Stack

pytestmark = pytest.mark.integration
TENANT = "br-alice"


def openai_client(bridge: BridgeProcess, tenant: str = TENANT) -> openai.OpenAI:
    return openai.OpenAI(
        api_key=bridge_key(tenant), base_url=f"{bridge.url}/v1", max_retries=2, timeout=60
    )


def batch_input(tag: str, num_lines: int, *, max_tokens: int, extra: list[str] = ()) -> bytes:  # type: ignore[assignment]
    rows = [
        json.dumps(
            {
                "custom_id": f"{tag}-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": "tiny-llama",
                    "prompt": f"{tag} line {i}",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                },
            }
        )
        for i in range(num_lines)
    ]
    return ("\n".join([*rows, *extra]) + "\n").encode()


def submit(client: openai.OpenAI, data: bytes, window: str = "24h") -> Batch:
    uploaded = client.files.create(file=("lines.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/completions",
        completion_window=window,  # type: ignore[arg-type]
    )


async def poll(client: openai.OpenAI, batch_id: str, until: Any, timeout_s: float = 300) -> Batch:
    batch: Batch = await eventually(
        lambda: client.batches.retrieve(batch_id), timeout_s=timeout_s, until=until
    )
    return batch


def ended(batch: Batch) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(row) for row in text.split("\n") if row]  # JSON leaves U+2028 as is


def results_of(
    client: openai.OpenAI, batch: Batch
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)


def assert_each_custom_id_once(
    good: list[dict[str, Any]], bad: list[dict[str, Any]], expected: set[str]
) -> None:
    counts = Counter(line["custom_id"] for line in good + bad)
    repeated = {custom_id: n for custom_id, n in counts.items() if n > 1}
    assert not repeated, f"custom_ids with more than one result: {repeated}"
    assert set(counts) == expected


def output_usage(good: list[dict[str, Any]]) -> tuple[int, int]:
    usage = [line["response"]["body"]["usage"] for line in good]
    return sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage)


def clickhouse_rows(settings: Settings, batch_id: str) -> list[dict[str, Any]]:
    """The batch's rows, by the batch_id the job stamped on them; every one of its
    request ids is one of the batch's lines."""
    rows: list[dict[str, Any]] = open_reader(settings).query(
        "SELECT request_id, attempt, status, prompt_tokens, completion_tokens, billed_units"
        " FROM usage_events WHERE tenant_id = %(tenant)s AND batch_id = %(batch)s",
        {"tenant": TENANT, "batch": batch_id},
    )
    assert all(row["request_id"].startswith(f"{batch_id}.") for row in rows), rows
    return rows


async def topic_values(settings: Settings, topic: str) -> list[bytes]:
    """Every record's value on ``topic``, from the beginning of each partition."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    values: list[bytes] = []
    try:
        tps = [
            TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or {0})
        ]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while fetched := await consumer.getmany(timeout_ms=2_000):
            values += [record.value for records in fetched.values() for record in records]
    finally:
        await consumer.stop()
    return values


async def usage_events(settings: Settings, batch_id: str) -> list[UsageEvent]:
    """Every UsageEvent of the batch's lines on the usage topic (not deduplicated)."""
    events: list[UsageEvent] = []
    for value in await topic_values(settings, Topics(settings.topic_prefix).usage):
        try:
            event = decode(UsageEvent, value)
        except SchemaError:
            continue
        if event.tenant_id == TENANT and event.request_id.startswith(f"{batch_id}."):
            events.append(event)
    return events


async def reply_token_counts(settings: Settings, batch_id: str) -> dict[str, list[int]]:
    """Request id --> the tokens of each of its chunks on the batch's reply topic, by seq."""
    topic = Topics(settings.topic_prefix).batch_replies(TENANT, batch_id)
    chunks: dict[str, dict[int, int]] = {}
    for value in await topic_values(settings, topic):
        for chunk in decode_batch(value).chunks:
            chunks.setdefault(chunk.request_id, {})[chunk.seq] = chunk.num_tokens
    return {rid: [n for _, n in sorted(seqs.items())] for rid, seqs in chunks.items()}


@pytest.fixture(scope="module")
def short_window_bridge(stack: Stack) -> Iterator[BridgeProcess]:
    """A bridge that accepts completion windows of seconds, for the expiry test."""
    process = start_bridge(stack, batch_min_window_s=1.0)
    yield process
    process.stop()


async def test_500_lines_through_the_openai_client_complete_each_custom_id_once(
    bridge: BridgeProcess, settings: Settings
) -> None:
    client = openai_client(bridge)
    tag = f"ok{int(time.time())}"
    malformed = ['{"custom_id": "broken", "method": "POST", "url": ', json.dumps({
        "custom_id": f"{tag}-forbidden", "method": "POST", "url": "/v1/completions",
        "body": {"model": "other-model", "prompt": "x", "max_tokens": 2},
    })]  # fmt: skip
    batch = submit(client, batch_input(tag, 500, max_tokens=2, extra=malformed))
    assert batch.request_counts is not None and batch.request_counts.total == 502
    assert batch.errors is not None
    assert [(e.line, e.code) for e in batch.errors.data or []] == [
        (501, "invalid_json"),
        (502, "model_not_allowed"),
    ]
    started = time.monotonic()
    batch = await poll(client, batch.id, ended, timeout_s=420)
    print(f"500 lines in {time.monotonic() - started:.1f} s")
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (500, 2)
    good, bad = results_of(client, batch)
    assert len(good) == 500 and len(bad) == 2
    expected = {f"{tag}-{i}" for i in range(500)} | {None, f"{tag}-forbidden"}
    assert_each_custom_id_once(good, bad, expected)  # type: ignore[arg-type]
    assert all(line["response"]["status_code"] == 200 for line in good)
    broken = next(line for line in bad if line["custom_id"] is None)
    assert broken["error"]["code"] == "invalid_json"
    assert broken["error"]["message"].startswith("line 501: ")
    assert batch.usage is not None
    prompt, completion = output_usage(good)
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt, completion)
    assert completion == 500 * 2

    def ran_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Lines shed under load (class 2, ``overloaded``) have a rejected row each, and
        # ran later under the same line: they are not among the rows that ran.
        return [row for row in rows if row["status"] != UsageStatus.REJECTED.value]

    rows = await eventually(
        lambda: clickhouse_rows(settings, batch.id),
        timeout_s=60,
        until=lambda r: len(ran_rows(r)) >= 500,
    )
    ran = ran_rows(rows)
    assert len({row["request_id"].split(".")[1] for row in ran}) == len(ran) == 500
    assert (sum(r["prompt_tokens"] for r in ran), sum(r["completion_tokens"] for r in ran)) == (
        prompt,
        completion,
    )


async def test_a_batch_is_bound_as_the_credential_that_created_it(
    bridge: BridgeProcess, settings: Settings, bridge_rsa_key: Any
) -> None:
    # A token with nothing left to spend: its batch's lines are refused as its own
    # requests would be, not run on the tenant's service token.
    now = int(time.time())
    claims = {"tenant": TENANT, "aud": "tokenbus", "exp": now + 300, "nbf": now - 1}
    token = jwt.encode({**claims, "quota_balance": "0"}, bridge_rsa_key, algorithm="RS256")
    by_token = openai.OpenAI(api_key=token, base_url=f"{bridge.url}/v1", max_retries=2, timeout=60)
    tag = f"bd{now}"
    batch = await poll(by_token, submit(by_token, batch_input(tag, 3, max_tokens=2)).id, ended)
    good, bad = results_of(by_token, batch)
    assert good == [] and len(bad) == 3
    assert {line["error"]["code"] for line in bad} == {"insufficient_quota"}
    # An API key's batch: each line's usage is filed under that key, as its requests'.
    client = openai_client(bridge)
    batch = await poll(client, submit(client, batch_input(f"{tag}k", 2, max_tokens=2)).id, ended)
    assert batch.status == "completed"

    def keys() -> list[str | None]:
        rows = open_reader(settings).query(
            "SELECT key_sha256 FROM usage_events WHERE tenant_id = %(t)s AND batch_id = %(b)s",
            {"t": TENANT, "b": batch.id},
        )
        return [row["key_sha256"] for row in rows]

    key_sha256 = hashlib.sha256(bridge_key(TENANT).encode()).hexdigest()
    assert await eventually(keys, until=lambda k: len(k) == 2) == [key_sha256, key_sha256]


async def test_batch_lines_stream_their_tokens_at_the_batch_interval(
    bridge: BridgeProcess, settings: Settings
) -> None:
    """No one reads a batch line as it streams: its tokens reach the runner in chunks of
    ``batch_stream_interval`` (the first and the last at once), and the output and
    billing hold every one of them.

    vLLM merges a request's waiting deltas when the worker takes them late (its
    ``RequestOutputCollector``), so a loaded worker may write two intervals as one chunk:
    [1, 16, 22] rather than [1, 16, 16, 6]. Every chunk but the last still ends on the
    interval's grid, which a stream at any other interval would not."""
    interval = settings.batch_stream_interval
    assert interval > settings.stream_interval
    client = openai_client(bridge)
    tag = f"si{int(time.time())}"
    num_tokens = 2 * interval + 7
    batch = submit(client, batch_input(tag, 3, max_tokens=num_tokens))
    batch = await poll(client, batch.id, ended, timeout_s=300)
    assert batch.status == "completed"
    good, bad = results_of(client, batch)
    assert (len(good), len(bad)) == (3, 0)
    counts = await reply_token_counts(settings, batch.id)
    for line in good:
        assert line["response"]["body"]["usage"]["completion_tokens"] == num_tokens
        request_id = line["response"]["request_id"]
        chunks = counts[request_id]
        ends = list(itertools.accumulate(chunks))
        # The grid starts at 1 (the first token at once) and steps by the interval.
        assert ends[-1] == num_tokens and 2 <= len(chunks) <= 4, (request_id, counts)
        assert all((end - 1) % interval == 0 for end in ends[:-1]), (request_id, counts)
    rows = await eventually(
        lambda: clickhouse_rows(settings, batch.id), timeout_s=60, until=lambda r: len(r) >= 3
    )
    assert [r["completion_tokens"] for r in rows] == [num_tokens] * 3


async def test_cancel_lets_running_lines_finish_and_cancels_the_rest(
    bridge: BridgeProcess,
) -> None:
    client = openai_client(bridge)
    tag = f"cx{int(time.time())}"
    batch = submit(client, batch_input(tag, 1500, max_tokens=16))
    await poll(
        client,
        batch.id,
        lambda b: ended(b) or (b.request_counts is not None and b.request_counts.completed >= 10),
        timeout_s=120,
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    batch = await poll(client, batch.id, ended, timeout_s=120)
    assert batch.status == "cancelled"
    assert batch.cancelled_at is not None
    good, bad = results_of(client, batch)
    assert_each_custom_id_once(good, bad, {f"{tag}-{i}" for i in range(1500)})
    codes = Counter(line["error"]["code"] for line in bad)
    assert codes["batch_cancelled"] > 0 and set(codes) == {"batch_cancelled"}, codes
    assert len(good) >= 10
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(good), len(bad))
    with pytest.raises(openai.APIStatusError) as again:
        client.batches.cancel(batch.id)
    assert again.value.status_code == 409


async def test_expiry_ends_the_lines_not_done_in_time(short_window_bridge: BridgeProcess) -> None:
    client = openai_client(short_window_bridge)
    tag = f"ex{int(time.time())}"
    batch = submit(client, batch_input(tag, 1500, max_tokens=16), window="3s")
    assert batch.expires_at == batch.created_at + 3
    batch = await poll(client, batch.id, ended, timeout_s=120)
    assert batch.status == "expired"
    assert batch.expired_at is not None and batch.expired_at >= batch.created_at + 3
    good, bad = results_of(client, batch)
    assert_each_custom_id_once(good, bad, {f"{tag}-{i}" for i in range(1500)})
    codes = Counter(line["error"]["code"] for line in bad)
    assert codes["batch_expired"] > 0 and set(codes) == {"batch_expired"}, codes


async def test_the_runner_the_job_and_a_worker_killed_mid_batch_every_line_runs_once(
    bridge: BridgeProcess, stack: Stack, settings: Settings
) -> None:
    # The stack's one worker is killed too: its batch lines wait in the job's queue
    # until it is back, and their streams resume there (class 2 waits, never fails).
    client = openai_client(bridge)
    tag = f"kl{int(time.time())}"
    num_lines = 2000
    batch = submit(client, batch_input(tag, num_lines, max_tokens=4))

    def completed(b: Batch) -> int:
        return b.request_counts.completed if b.request_counts is not None else 0

    async def progress_past(n: int) -> None:
        batch = await poll(client, batch_id, lambda b: ended(b) or completed(b) >= n, 300)
        assert not ended(batch), f"the batch ended before the next kill: {batch.status}"

    batch_id = batch.id
    await progress_past(100)
    await stack.restart("batches")  # SIGKILL the runner mid-batch, then start it again
    await progress_past(completed(client.batches.retrieve(batch_id)) + 100)
    await stack.restart("stream_job", timeout_s=180)  # SIGKILL the Faust job once
    await progress_past(completed(client.batches.retrieve(batch_id)) + 100)
    await stack.restart("worker-0", timeout_s=300)  # and a worker once
    batch = await poll(client, batch_id, ended, timeout_s=420)
    assert batch.status == "completed"
    good, bad = results_of(client, batch)
    assert (len(good), len(bad)) == (num_lines, 0)
    assert_each_custom_id_once(good, bad, {f"{tag}-{i}" for i in range(num_lines)})

    # On the usage topic itself: each line has one request id that ran (not a refusal),
    # and each attempt of it one run as billing keys it (tenant, session, request,
    # attempt). (A request the job sent again after its worker was lost continues the
    # same stream as attempt 1: each attempt is billed for the tokens it made.) A Faust
    # job SIGKILLed within its commit interval can admit a just-forwarded request again
    # under the same key (its ledger entry was not yet in the changelog): the engine
    # then runs that attempt twice, the batch keeps the first result (by seq) and
    # billing collapses the pair on its key. Such repeats are printed, not hidden.
    events = await usage_events(settings, batch_id)
    ran = [e for e in events if e.status is not UsageStatus.REJECTED]
    per_attempt = Counter((e.request_id, e.attempt) for e in ran)
    for e in ran:
        if per_attempt[(e.request_id, e.attempt)] > 1:
            print("repeated by the job:", e.request_id, e.attempt, e.worker_id, e.created_at)
    ran = list({(e.request_id, e.attempt): e for e in ran}.values())  # billing's key
    ids_by_line: dict[str, set[str]] = {}
    for e in ran:
        ids_by_line.setdefault(e.request_id.split(".")[1], set()).add(e.request_id)
    twice = {line: ids for line, ids in ids_by_line.items() if len(ids) > 1}
    assert not twice, f"lines that ran under more than one request id: {twice}"
    assert len(ids_by_line) == num_lines
    prompt, completion = output_usage(good)
    assert sum(e.num_completion_tokens for e in ran) == completion
    last_attempt = {e.request_id: e for e in sorted(ran, key=lambda e: e.attempt)}
    assert sum(e.num_prompt_tokens for e in last_attempt.values()) == prompt
    # ... and billing holds each attempt once, with the output's usage.
    rows = await eventually(
        lambda: clickhouse_rows(settings, batch_id),
        timeout_s=60,
        until=lambda r: len([x for x in r if x["status"] != "rejected"]) >= len(per_attempt),
    )
    billed = [row for row in rows if row["status"] != UsageStatus.REJECTED.value]
    assert len(billed) == len(per_attempt)
    assert sum(r["completion_tokens"] for r in billed) == completion
    last_billed = {r["request_id"]: r for r in sorted(billed, key=lambda r: r["attempt"])}
    assert sum(r["prompt_tokens"] for r in last_billed.values()) == prompt


def test_the_cli_submits_follows_and_collects_a_batch(stack: Stack, tmp_path: Path) -> None:
    from tokenbus_cli.stack import REPO_ROOT, settings_env

    env = settings_env(stack.settings)
    tag = f"cli{int(time.time())}"
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(batch_input(tag, 50, max_tokens=2, extra=["not json"]))

    def tokenbus(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "tokenbus_cli.cli", "batch", *args],
            env=env, cwd=REPO_ROOT, capture_output=True, timeout=180,
        )  # fmt: skip

    submitted = tokenbus("submit", str(path), "--tenant", "batch-cli", "--metadata", "job=cli")
    assert submitted.returncode == 0, submitted.stderr.decode()
    batch_id = submitted.stdout.decode().splitlines()[0]
    assert batch_id.startswith("batch_")
    assert b"line 51: invalid_json" in submitted.stderr
    assert f"batch {batch_id} completed".encode() in submitted.stdout

    status = tokenbus("status", batch_id)
    doc = json.loads(status.stdout)
    assert (doc["status"], doc["tenant"], doc["metadata"]) == (
        "completed",
        "batch-cli",
        {"job": "cli"},
    )
    assert doc["request_counts"] == {"total": 51, "completed": 50, "failed": 1}

    results = tokenbus("results", batch_id)
    lines = [json.loads(row) for row in results.stdout.split(b"\n") if row]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"{tag}-{i}" for i in range(50))
    errors = tokenbus("results", batch_id, "--errors")
    codes = [json.loads(row)["error"]["code"] for row in errors.stdout.split(b"\n") if row]
    assert codes == ["invalid_json"]
    again = tokenbus("cancel", batch_id)
    assert again.returncode != 0 and b"completed already" in again.stderr
    refused = tokenbus("submit", str(path), "--tenant", "batch-cli", "--window", "forever")
    assert refused.returncode != 0 and b"invalid_completion_window" in refused.stderr


def test_prune_topics_deletes_the_reply_topics_of_ended_batches_only(
    stack: Stack, tmp_path: Path
) -> None:
    from tokenbus_cli.stack import REPO_ROOT, settings_env

    env = settings_env(stack.settings)
    topics = Topics(stack.settings.topic_prefix)
    tenant = "batch-prune"
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(batch_input(f"prune{int(time.time())}", 3, max_tokens=2))

    def tokenbus(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "tokenbus_cli.cli", "batch", *args],
            env=env, cwd=REPO_ROOT, capture_output=True, timeout=180,
        )  # fmt: skip

    submitted = tokenbus("submit", str(path), "--tenant", tenant)
    assert submitted.returncode == 0, submitted.stderr.decode()
    batch_id = submitted.stdout.decode().splitlines()[0]
    ended = topics.batch_replies(tenant, batch_id)
    # A batch topic the store does not know (its document lost, or another cluster's).
    unknown = topics.batch_replies(tenant, "batch_0000unknown0000")
    asyncio.run(ensure_topics(stack.settings, {unknown: 1}))
    try:
        assert {ended, unknown} <= asyncio.run(topic_names(stack.settings))
        recent = tokenbus("prune-topics", "--tenant", tenant, "--older-than", "1d")
        assert recent.returncode == 0, recent.stderr.decode()
        assert f"keeping {ended}: the batch ended".encode() in recent.stdout
        assert f"keeping {unknown}: no status document in the store".encode() in recent.stdout

        time.sleep(1.1)  # the batch ended over a second ago
        dry = tokenbus("prune-topics", "--tenant", tenant, "--older-than", "1s", "--dry-run")
        assert f"would delete {ended}".encode() in dry.stdout, dry.stdout.decode()
        assert ended in asyncio.run(topic_names(stack.settings))
        pruned = tokenbus("prune-topics", "--tenant", tenant, "--older-than", "1s")
        assert pruned.returncode == 0, pruned.stderr.decode()
        assert b"1 reply topics of ended batches deleted" in pruned.stdout, pruned.stdout.decode()
        left = asyncio.run(topic_names(stack.settings))
        assert ended not in left and unknown in left
        # The batch's results are its files, which stay.
        results = tokenbus("results", batch_id)
        assert len([row for row in results.stdout.split(b"\n") if row]) == 3
        bad = tokenbus("prune-topics", "--older-than", "soon")
        assert bad.returncode != 0 and b"is not a duration" in bad.stderr
        bad = tokenbus("prune-topics", "--tenant", "../etc")
        assert bad.returncode != 0 and b"is not a tenant id" in bad.stderr
    finally:
        asyncio.run(delete_topics(stack.settings, [unknown]))
