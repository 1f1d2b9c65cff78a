"""The interval's interactive samples and the LoadReport made of them."""

from __future__ import annotations

from schemas import LoadReport, WorkerStatus, decode, encode
from stream_jobs.load import LoadTracker, Samples, load_report, quantile


def worker(worker_id: str, *, running: int, waiting: int, seats: int, kv: float) -> WorkerStatus:
    return WorkerStatus(
        worker_id=worker_id,
        model="m",
        request_topic=f"tokenbus.worker.{worker_id}",
        num_running=running,
        num_waiting=waiting,
        max_num_seqs=seats,
        kv_cache_usage=kv,
    )


def test_only_interactive_classes_are_sampled_per_model() -> None:
    tracker = LoadTracker()
    for ms in (1.0, 2.0, 3.0):
        tracker.note_queue_wait("m", 1, ms)
    tracker.note_queue_wait("m", 0, 9.0)
    tracker.note_queue_wait("m", 2, 500.0)  # a batch line's wait says nothing of interactive
    tracker.note_usage("m", 1, 40.0)
    tracker.note_usage("m", 2, 900.0)
    tracker.note_usage("m", 0, None)  # no first token: nothing to sample
    tracker.note_usage("other", 0, 7.0)

    taken = tracker.take()

    assert taken["m"].queue_ms == [1.0, 2.0, 3.0, 9.0]
    assert taken["m"].ttft_ms == [40.0]
    assert taken["other"].ttft_ms == [7.0]
    assert tracker.take() == {}  # handed over: the next interval starts empty


def test_an_interval_keeps_its_latest_samples_when_over_its_bound() -> None:
    tracker = LoadTracker(max_samples=3)
    for ms in range(10):
        tracker.note_queue_wait("m", 0, float(ms))
    assert tracker.take()["m"].queue_ms == [7.0, 8.0, 9.0]


def test_quantiles_are_nearest_rank_and_none_when_empty() -> None:
    samples = [float(n) for n in range(1, 101)]
    assert (quantile(samples, 0.5), quantile(samples, 0.99)) == (51.0, 100.0)
    assert quantile([], 0.5) is None


def test_a_report_sums_the_workers_and_carries_the_interval_figures() -> None:
    report = load_report(
        "m",
        instance="job-1",
        interval_s=1.0004,
        samples=Samples(queue_ms=[2.0, 4.0], ttft_ms=[30.0, 50.0, 70.0]),
        waiting_by_class=[1, 2, 30],
        workers=[
            worker("w0", running=10, waiting=1, seats=32, kv=0.4),
            worker("w1", running=12, waiting=0, seats=32, kv=0.7),
        ],
        num_in_flight=22,
        num_batch_in_flight=15,
    )

    assert report.num_waiting_by_class == [1, 2, 30]
    assert (report.interactive_queue_ms_p50, report.interactive_queue_ms_p99) == (4.0, 4.0)
    assert (report.interactive_ttft_ms_p50, report.interactive_ttft_ms_p99) == (50.0, 70.0)
    assert (report.num_interactive_dispatched, report.num_interactive_finished) == (2, 3)
    assert (report.num_workers, report.num_running, report.num_waiting) == (2, 22, 1)
    assert (report.max_num_seqs, report.kv_cache_usage) == (64, 0.7)
    assert (report.num_in_flight, report.num_batch_in_flight, report.interval_s) == (22, 15, 1.0)
    assert decode(LoadReport, encode(report)) == report  # as it travels on the bus


def test_a_model_without_workers_or_samples_reports_zeros_and_no_latency() -> None:
    report = load_report(
        "m",
        instance="job-1",
        interval_s=1.0,
        samples=None,
        waiting_by_class=[0, 0, 4],
        workers=[],
        num_in_flight=0,
        num_batch_in_flight=0,
    )
    assert report.interactive_queue_ms_p99 is None and report.interactive_ttft_ms_p99 is None
    assert (report.num_workers, report.max_num_seqs, report.kv_cache_usage) == (0, 0, 0.0)
