"""Where a request waits on its way into the Faust job, from ``bench/fetchwatch``'s lines.

    .venvs/stream/bin/python -m bench.fetch_legs /tmp/fetchwatch [--first 100]

For the job's first ``--first`` request records (``bench.admission``'s idle probes,
sent one at a time, come first), in ms, p50 and p90 (``bench.stats``, nearest rank) with the count:

- sent → handed over: from the record's timestamp (its producer's clock, whole ms) to
  Faust's consumer thread handing it over: the broker's hop, its fetch included;
- handed over → admitted: Faust's hand-off to the job's loop, its stream and the admit
  agent, to ``Dispatcher.admit``;
- admitted → picked: admission, the fair queue and the dispatch loop, to ``_pick``
  (the n-th admission paired with the n-th pick: one request at a time);

and the job's fetch requests of more than one partition, from start to end, with and
without records. A diagnostic of the bundled broker's hop (bench/JOURNAL.md, "What changed
on 2026-12-05 (night)"), not a benchmark of record.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from bench.stats import summarize

Key = tuple[str, str, str]


def legs(lines: Iterable[str], first: int) -> dict[str, list[float]]:
    """Each leg's ms for the first ``first`` records, and the fetches' durations."""
    handed: dict[Key, tuple[float, float]] = {}
    admitted: list[tuple[Key, float]] = []
    picked: list[float] = []
    fetches: dict[str, list[float]] = {"fetch with records": [], "fetch without": []}
    for line in lines:
        kind, *fields = line.split()
        if kind == "F":
            topic, partition, offset, sent_ms, at = fields
            handed.setdefault((topic, partition, offset), (int(sent_ms) / 1000, float(at)))
        elif kind == "A":
            topic, partition, offset, at = fields
            admitted.append(((topic, partition, offset), float(at)))
        elif kind == "P":
            picked.append(float(fields[1]))
        elif kind == "R" and int(fields[3]) > 1:
            started, ended, has_data = float(fields[0]), float(fields[1]), fields[2] == "1"
            fetches["fetch with records" if has_data else "fetch without"].append(
                1000 * (ended - started)
            )
    out: dict[str, list[float]] = {
        "sent → handed over": [],
        "handed over → admitted": [],
        "admitted → picked": [],
    }
    for n, (key, admitted_at) in enumerate(admitted[:first]):
        if key in handed:
            sent, handed_at = handed[key]
            out["sent → handed over"].append(1000 * (handed_at - sent))
            out["handed over → admitted"].append(1000 * (admitted_at - handed_at))
        if n < len(picked):
            out["admitted → picked"].append(1000 * (picked[n] - admitted_at))
    return {**out, **fetches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--first", type=int, default=100)
    args = parser.parse_args()
    lines = [
        line for path in sorted(args.directory.iterdir()) for line in path.read_text().splitlines()
    ]
    print("| leg | ms p50 | ms p90 | n |")
    print("|---|---|---|---|")
    for name, values in legs(lines, args.first).items():
        if values:
            summary = summarize(values)
            print(f"| {name} | {summary['p50']:.2f} | {summary['p90']:.2f} | {len(values)} |")


if __name__ == "__main__":
    main()
