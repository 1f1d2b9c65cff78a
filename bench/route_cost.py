"""The job's CPU per pick of a worker, as the fleet serving a model grows (pure policy).

    .venvs/stream/bin/python -m bench.route_cost [--workers 1 8 64 256] [--repeat 5]

``bench.admission`` runs one pretend worker by default, where choosing a worker costs
next to nothing; the job's pick reads every live worker of the request's model. Each
point observes ``workers`` heartbeats of one model, then times what
``Dispatcher._pick`` does to choose, per request: the live workers' routing candidates
(``WorkerRegistry.live``, ``WorkerView.candidate``), ``choose_for_adapter`` for a
base-model request with a previous worker for its session (one of ten sessions), and
``note_dispatch`` on the chosen worker. A heartbeat (a worker's is one a second) makes a
new view and so a new candidate: at thousands of picks a second that is a few candidates
a pick at most, left out here. CPU time of this process (``time.process_time``), the
median of ``--repeat`` runs with its spread, written to ``bench/results/route_cost-*.json``:
``bench.summary`` takes its slope per live worker for the capacity model. No broker, no
job.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.report import uptime_load, write_result
from schemas import WorkerStatus
from stream_jobs.adapter_routing import choose_for_adapter
from stream_jobs.registry import WorkerRegistry
from stream_jobs.routing import RoutingWeights

MODEL = "m"
SESSIONS = 10


def fleet(num_workers: int, now: float = 0.0) -> WorkerRegistry:
    """A registry that has heard one heartbeat from each of ``num_workers`` workers."""
    registry = WorkerRegistry(dead_after_s=3600.0)
    for n in range(num_workers):
        registry.observe(
            WorkerStatus(
                worker_id=f"w{n:04d}",
                model=MODEL,
                request_topic=f"bench.worker.w{n:04d}",
                max_num_seqs=256,
                num_running=n % 7,
                incarnation="run-1",
            ),
            now,
        )
    return registry


def picks(registry: WorkerRegistry, num_picks: int) -> dict[str, int]:
    """``num_picks`` picks as the dispatcher makes them; the picks each worker got."""
    weights, now = RoutingWeights(), 1.0
    previous: dict[int, str] = {}
    counts: dict[str, int] = {}
    for n in range(num_picks):
        session = n % SESSIONS
        candidates = [view.candidate() for view in registry.live(MODEL, now)]
        chosen = choose_for_adapter(
            candidates, 1, weights, adapter=None, previous=previous.get(session)
        )
        assert chosen is not None
        registry.note_dispatch(chosen.worker_id, None, now)
        previous[session] = chosen.worker_id
        counts[chosen.worker_id] = counts.get(chosen.worker_id, 0) + 1
    return counts


def us_per_pick(num_workers: int, num_picks: int) -> float:
    registry = fleet(num_workers)
    began = time.process_time()
    picks(registry, num_picks)
    return (time.process_time() - began) / num_picks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--picks", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    load_start = uptime_load()
    print("| live workers of the model | µs per pick, median | min..max |")
    print("|---|---|---|")
    rows = []
    for num_workers in args.workers:
        runs = [us_per_pick(num_workers, args.picks) for _ in range(args.repeat)]
        median = statistics.median(runs)
        print(f"| {num_workers} | {median:.1f} | {min(runs):.1f}..{max(runs):.1f} |")
        rows.append(
            {
                "num_workers": num_workers,
                "num_picks": args.picks,
                "us_per_pick": {"median": median, "min": min(runs), "max": max(runs)},
            }
        )
    path = write_result("route_cost", {"load_start": load_start, "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
