"""``python -m stream_jobs`` with the prototypes named in $BENCH_PROTOTYPES applied."""

from __future__ import annotations

import sys

from bench.prototypes import apply_from_env


def main() -> int:
    applied = apply_from_env()
    print(f"bench prototypes applied: {applied}", flush=True)
    from stream_jobs.__main__ import main as job_main

    return job_main()


if __name__ == "__main__":
    sys.exit(main())
