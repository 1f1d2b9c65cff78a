"""Interactive load per model, over the interval between two load reports. Pure.

# a forward (its queue wait) + a UsageEvent (its TTFT) --> LoadTracker, per model
# --> take(): the interval's samples --> load_report() with the job's and workers' counts
# --> LoadReport (published by the app to ``<prefix>.load``, keyed by model)

Only classes 0 and 1 are sampled: the figures say how interactive traffic fares, which
is what a batch pacer yields to. Samples are kept per interval only, bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas import LoadReport, WorkerStatus

INTERACTIVE = (0, 1)
_MAX_SAMPLES = 10_000
"""Per model and interval; past it the interval keeps its latest samples."""


@dataclass
class Samples:
    queue_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)


def quantile(samples: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank, as the job's metrics take it), None if empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class LoadTracker:
    """The interval's interactive samples, per model; ``take`` hands them over and resets."""

    def __init__(self, max_samples: int = _MAX_SAMPLES) -> None:
        self._max = max_samples
        self._by_model: dict[str, Samples] = {}

    def note_queue_wait(self, model: str, priority: int, queue_ms: float) -> None:
        if priority in INTERACTIVE:
            _append(self._samples(model).queue_ms, queue_ms, self._max)

    def note_usage(self, model: str, priority: int, ttft_ms: float | None) -> None:
        if priority in INTERACTIVE and ttft_ms is not None:
            _append(self._samples(model).ttft_ms, ttft_ms, self._max)

    def take(self) -> dict[str, Samples]:
        taken, self._by_model = self._by_model, {}
        return taken

    def _samples(self, model: str) -> Samples:
        found = self._by_model.get(model)
        if found is None:
            found = self._by_model[model] = Samples()
        return found


def _append(samples: list[float], value: float, limit: int) -> None:
    samples.append(value)
    if len(samples) > limit:
        del samples[: len(samples) - limit]


def load_report(
    model: str,
    *,
    instance: str,
    interval_s: float,
    samples: Samples | None,
    waiting_by_class: list[int],
    workers: Iterable[WorkerStatus],
    num_in_flight: int,
    num_batch_in_flight: int,
) -> LoadReport:
    """One model's report: the interval's samples, the job's queue and in-flight counts,
    and its live workers' last heartbeats."""
    samples = samples or Samples()
    live = list(workers)
    return LoadReport(
        model=model,
        instance=instance,
        interval_s=round(interval_s, 3),
        num_waiting_by_class=waiting_by_class,
        interactive_queue_ms_p50=quantile(samples.queue_ms, 0.5),
        interactive_queue_ms_p99=quantile(samples.queue_ms, 0.99),
        num_interactive_dispatched=len(samples.queue_ms),
        interactive_ttft_ms_p50=quantile(samples.ttft_ms, 0.5),
        interactive_ttft_ms_p99=quantile(samples.ttft_ms, 0.99),
        num_interactive_finished=len(samples.ttft_ms),
        num_workers=len(live),
        num_running=sum(w.num_running for w in live),
        num_waiting=sum(w.num_waiting for w in live),
        max_num_seqs=sum(w.max_num_seqs for w in live),
        kv_cache_usage=max((w.kv_cache_usage for w in live), default=0.0),
        num_in_flight=num_in_flight,
        num_batch_in_flight=num_batch_in_flight,
    )
