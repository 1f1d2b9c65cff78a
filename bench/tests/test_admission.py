from __future__ import annotations

from pathlib import Path

from bench.admission import Credentials, build_requests
from tokenbus.config import Settings
from tokenbus.prompt_vouch import HEADER, vouched

SECRET = "bench-test-bus-service-secret-0123456789"


def test_records_carry_the_bridge_s_vouched_count_only_when_the_bridge_counted(
    tmp_path: Path,
) -> None:
    credentials = Credentials(Settings(home=tmp_path, bus_service_secret=SECRET))
    bridge = build_requests(4, 2, 20, "m", "tokenbus.replies.bench", credentials, 23)
    program = build_requests(4, 2, 20, "m", "tokenbus.replies.bench", credentials)
    for _, value, headers in bridge:
        assert vouched(SECRET, value, dict(headers)[HEADER]) == 23
    for _, _, headers in program:
        assert [name for name, _ in headers] == ["authorization"]
    # Each record's vouch is its own: ids differ, and so do the values.
    assert len({dict(headers)[HEADER] for _, _, headers in bridge}) == 4
