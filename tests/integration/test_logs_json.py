"""``TOKENBUS_LOG_FORMAT=json`` on the stack ``tokenbus up`` runs: every service writes
one JSON object per line, and the worker's lines about a request carry that request's
tenant, ids and attempt.

The worker's log also holds what native code and libraries write straight to the
stream (torch's C++ warnings, a checkpoint loader's progress bar, prints): not log
records, so not JSON; but no log record, tokenbus's or vLLM's, is written as text."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import orjson

from tests.integration.test_up_lifecycle import env_for, start_up

SERVICES = ("stream_job", "bridge", "billing", "alerts", "worker-0")
NOT_RECORDS = {"worker-0"}
"""Services whose log may also hold native output (see above)."""
TEXT_RECORD = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} |\([^)]*\) )?"
    r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
)
"""A log record in text: ours (``asctime levelname name``) or vLLM's (``INFO 12-01 ...``,
``(EngineCore_DP0 pid=1) INFO ...``)."""


def ask(env: dict[str, str], home: Path) -> str:
    key = (home / "dev-api-key").read_text().strip()
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{env['TOKENBUS_BRIDGE_PORT']}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        return str(response.headers["X-Request-ID"])


def test_every_service_logs_json_lines_that_name_their_request(
    tmp_path: Path, model_dir: Path
) -> None:
    env = {
        **env_for(tmp_path, model_dir),
        "TOKENBUS_LOG_FORMAT": "json",
        "TOKENBUS_DEBUG_LOGGERS": '["workers.worker"]',
    }
    process, err = start_up(tmp_path, env)
    try:
        request_id = ask(env, tmp_path)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, err.read_text()
    finally:
        process.kill()
        process.wait()
    logs = tmp_path / "logs"
    about_request = []
    for service in SERVICES:
        text = (logs / f"{service}.log").read_text(errors="replace")
        lines = [line for line in text.splitlines() if line.strip()]
        assert lines, service
        for line in lines:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                assert service in NOT_RECORDS, f"{service}: not a JSON line: {line!r}"
                assert not TEXT_RECORD.match(line), f"{service}: a text record: {line!r}"
                continue
            assert {"ts", "level", "logger", "message"} <= record.keys(), (service, line)
            if record.get("request_id") == request_id:
                about_request.append(record)
    reported = [r for r in about_request if r["message"] == "reported: ok"]
    assert len(reported) == 1, about_request
    (line,) = reported
    assert line["logger"] == "workers.worker" and line["attempt"] == 0
    assert line["tenant"] and line["session_id"] and line["num_completion_tokens"] >= 1
