"""Imports flow one way: schemas <-- tokenbus <-- producers <-- each service <-- tokenbus_cli
and bench.

Read from the source (every ``import`` and ``from ... import``, at the top of a module or
inside a function), so a lazy import cannot hide an edge. ``tokenbus`` is the library
every service may use; ``producers`` is the client (``TokenbusClient``) of any program
that produces requests, the bridge and the batch runner among them, and uses only the
library and the data. A service may import those three layers, never another service:
what two services both need belongs in ``tokenbus``.
"""

from __future__ import annotations

import ast
import gc
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = "schemas"
LIBRARY = "tokenbus"
CLIENT = "producers"
SERVICES = ("stream_jobs", "bridge", "workers", "billing", "batches")
TOP = ("tokenbus_cli", "bench")
PROJECT = (DATA, LIBRARY, CLIENT, *SERVICES, *TOP)

ALLOWED: dict[str, set[str]] = {
    DATA: {DATA},
    LIBRARY: {DATA, LIBRARY},
    CLIENT: {DATA, LIBRARY, CLIENT},
    **{service: {DATA, LIBRARY, CLIENT, service} for service in SERVICES},
    **{top: set(PROJECT) for top in TOP},
}


def imported(path: Path) -> Iterator[str]:
    """The top-level package of every absolute import in one module."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module.split(".")[0]


@cache
def edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) between project packages --> the modules that import so.

    The earlier tests' garbage is collected first: a collection that runs inside
    ``ast.parse`` and finalizes one of their objects can make CPython 3.11's AST
    constructor raise "recursion depth mismatch" (python/cpython#106905)."""
    gc.collect()
    return _edges()


def _edges() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for package in PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if package == "bench" and "tests" in path.relative_to(ROOT / package).parts:
                continue  # bench's own tests, like tests/, may import anything
            for name in set(imported(path)) & set(PROJECT):
                if name != package:
                    found.setdefault((package, name), []).append(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("package", [DATA, LIBRARY, CLIENT, *SERVICES])
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    wrong = {
        edge: modules
        for edge, modules in edges().items()
        if edge[0] == package and edge[1] not in ALLOWED[package]
    }
    assert not wrong, f"imports against the layers: {wrong}"


def test_every_top_level_package_has_its_layer() -> None:
    # A new package must be placed in a layer here before the rules above can hold it.
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(PROJECT), packages - set(PROJECT)


def test_nothing_below_the_top_imports_the_cli_or_the_benchmarks() -> None:
    above = {edge: m for edge, m in edges().items() if edge[1] in TOP and edge[0] not in TOP}
    assert not above


def test_the_reader_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import a.b\ndef f():\n    from billing.x import y\n    from . import z\n")
    assert sorted(imported(module)) == ["a", "billing"]
