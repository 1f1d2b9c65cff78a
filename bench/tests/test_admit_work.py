"""bench.admit_work runs the job's dispatcher on bench.admission's records: every one is
forwarded, each with its spans when tracing is on."""

from __future__ import annotations

import asyncio

import pytest

from bench import admit_work
from tokenbus.span_buffer import SpanBuffer


@pytest.mark.parametrize("ratio", [1.0, 0.0], ids=["traced", "untraced"])
def test_every_record_is_forwarded_and_traced_as_configured(
    ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    filed: list[int] = []
    take = SpanBuffer.take

    def counted(self: SpanBuffer) -> dict[str, list[dict[str, object]]]:
        taken = take(self)
        filed.append(sum(len(spans) for spans in taken.values()))
        return taken

    monkeypatch.setattr(SpanBuffer, "take", counted)
    result = asyncio.run(admit_work.run_once(300, 3, ratio))
    assert result["outcomes"] == {"forwarded": 300}
    assert result["us_per_request"] > 0
    # job.admit and job.queue for each request (and the warm-up's), or none at all.
    assert sum(filed) == (2 * (300 + admit_work.BATCH) if ratio else 0)


def test_a_request_left_waiting_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admit_work, "BATCH", 10)
    monkeypatch.setattr(admit_work, "BATCH_TIMEOUT_S", 0.5)
    monkeypatch.setattr(admit_work, "WORKER_SEATS", 5)  # fewer seats than a batch
    with pytest.raises(TimeoutError):
        asyncio.run(admit_work.run_once(20, 2, 1.0))
