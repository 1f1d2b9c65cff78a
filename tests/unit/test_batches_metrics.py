from __future__ import annotations

from batches.metrics import RunnerMetrics
from schemas.batches import BatchDoc, RequestCounts


def test_a_batchs_progress_is_exported_and_dropped_when_it_ends() -> None:
    metrics = RunnerMetrics()
    doc = BatchDoc(
        id="batch_0123456789",
        endpoint="/v1/completions",
        input_file_id="file-0123456789",
        completion_window="24h",
        status="in_progress",
        created_at=1,
        tenant="acme",
        request_counts=RequestCounts(total=10, completed=6, failed=1),
        in_flight=2,
        eta_s=4.0,
    )
    metrics.observe(doc, num_left=3)
    text = metrics.render().decode()
    assert (
        'tokenbus_batch_lines{batch="batch_0123456789",state="remaining",tenant="acme"} 3.0' in text
    )
    assert (
        'tokenbus_batch_lines{batch="batch_0123456789",state="completed",tenant="acme"} 6.0' in text
    )
    assert 'tokenbus_batch_eta_seconds{batch="batch_0123456789",tenant="acme"} 4.0' in text
    metrics.forget("acme", doc.id)
    assert "batch_0123456789" not in metrics.render().decode()
