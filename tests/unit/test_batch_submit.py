"""``create_batch`` on a local store: the file is read a block at a time, and what it
holds at once does not grow with the file."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

import tokenbus.batch.submit
from schemas import SamplingParams
from schemas.batches import LineError, PreparedLine
from tokenbus.batch.lines import InputLine
from tokenbus.batch.store import BatchStore
from tokenbus.batch.submit import create_batch, file_doc
from tokenbus.config import Settings

CHAT = "/v1/chat/completions"


def prepared(line: InputLine) -> PreparedLine | LineError:
    content = line.body["messages"][0]["content"]
    if content.startswith("refuse"):
        return LineError(
            line_no=line.line_no, custom_id=line.custom_id, code="refused", message="no"
        )
    return PreparedLine(
        line_no=line.line_no,
        custom_id=line.custom_id,
        model=line.body["model"],
        prompt=content,
        sampling=SamplingParams(max_tokens=2),
    )


def jsonl(num_lines: int, content_chars: int) -> bytes:
    rows = (
        json.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": "tiny-llama",
                    "messages": [{"role": "user", "content": f"{i} " + "w" * content_chars}],
                },
            }
        )
        for i in range(num_lines)
    )
    return "".join(row + "\n" for row in rows).encode()


def create_traced(tmp_path: Path, raw: bytes) -> tuple[BatchStore, str, int]:
    """Creates a batch of ``raw``: the store, the batch's id, and the most memory the
    create held at once (``tracemalloc``: Python's allocations)."""
    settings = Settings(home=tmp_path)
    store = BatchStore(settings.batch_store)
    upload = file_doc("acme", "in.jsonl", len(raw), time.time())
    store.put_file(upload, raw)
    del raw
    tracemalloc.start()
    try:
        doc = create_batch(
            store,
            settings,
            tenant="acme",
            input_file_id=upload.id,
            endpoint=CHAT,
            completion_window="24h",
            metadata=None,
            check_body=prepared,
            now=time.time(),
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return store, doc.id, peak


def test_a_create_holds_a_few_lines_not_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenbus.batch.submit, "READ_BLOCK_BYTES", 65_536)
    raw = jsonl(500, 8_000)  # 4 MiB: held whole, parsed and encoded, it took 4 times that
    store, batch_id, peak = create_traced(tmp_path, raw)
    assert peak < len(raw) / 8
    assert [line.custom_id for line in store.lines("acme", batch_id)] == [
        f"req-{i}" for i in range(500)
    ]
