"""Put on PYTHONPATH by ``bench.overhead --prototype``: applies bench.prototypes to a
stack's Faust job when it imports ``stream_jobs.app``, and does nothing elsewhere.

The stack starts ``python -m stream_jobs`` itself; this hook is how a benchmark measures
a proposed change to the job without editing it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_TARGET = "stream_jobs.app"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            from bench.prototypes import apply_from_env

            print(f"bench prototypes applied: {apply_from_env()}", flush=True)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("BENCH_PROTOTYPES"):
    sys.meta_path.insert(0, _PatchAfterImport())
