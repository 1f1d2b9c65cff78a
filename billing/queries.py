"""The dashboard queries: ``billing/dashboards/NAME.sql``, one question per file.

Each file is plain ClickHouse SQL with ``{name:Type}`` parameters, so any ClickHouse
client runs it (``clickhouse client --param_tenant=acme < file.sql``). A header of
``--`` lines gives a title, a description, and one line per parameter with its JSON
default and what it means::

    -- Spend by tenant per day
    -- Billed cost units per tenant and day ...
    -- @param tenant = ""  one tenant, or every tenant when empty

Parameters travel as text and ClickHouse parses them by the type in the placeholder,
so ``--param since=2026-03-01`` and the query server's JSON need no conversion here.

Columns that several questions show alike are written once, in ``_NAME.sql`` beside
them, and a query takes them with a line ``-- @include NAME`` (indented as they go).
Such a file is whole only once read: ``python -m billing.queries NAME`` prints it ready
for a ClickHouse client or a dashboard tool
(``python -m billing.queries spend_per_batch | clickhouse client --param_tenant=acme``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DASHBOARDS_DIR = Path(__file__).with_name("dashboards")
_PLACEHOLDER = re.compile(r"\{(\w+):([^{}]+)\}")
_PARAM_LINE = re.compile(r"^--\s*@param\s+(\w+)\s*=\s*(.*)$")
_INCLUDE_LINE = re.compile(r"^(\s*)--\s*@include\s+(\w+)\s*$")


class QueryParamError(ValueError):
    """An unknown query name or parameter, or a file whose header and SQL disagree."""


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    """The ClickHouse type of its placeholder, e.g. ``DateTime64(3, 'UTC')``."""
    default: str
    description: str


@dataclass(frozen=True)
class DashboardQuery:
    name: str
    title: str
    description: str
    sql: str
    params: tuple[Param, ...]

    def to_sql(self, overrides: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]]:
        """The SQL and every parameter's value: the defaults, with ``overrides`` applied."""
        values = {param.name: param.default for param in self.params}
        unknown = set(overrides or {}) - set(values)
        if unknown:
            raise QueryParamError(
                f"{self.name} has no parameter {', '.join(sorted(unknown))}; "
                f"it takes {', '.join(values)}"
            )
        values.update(overrides or {})
        return self.sql, values


def dashboard_queries(directory: Path = DASHBOARDS_DIR) -> dict[str, DashboardQuery]:
    """Every query in ``directory``, by name (the file name without ``.sql``), sorted;
    ``_NAME.sql`` files are parts the queries include, not queries."""
    paths = sorted(p for p in directory.glob("*.sql") if not p.name.startswith("_"))
    return {path.stem: read_query(path) for path in paths}


def dashboard_query(name: str, directory: Path = DASHBOARDS_DIR) -> DashboardQuery:
    queries = dashboard_queries(directory)
    if name not in queries:
        raise QueryParamError(f"no dashboard query {name!r}; there are: {', '.join(queries)}")
    return queries[name]


def read_query(path: Path) -> DashboardQuery:
    text = path.read_text(encoding="utf-8")
    return parse_query(path.stem, include_parts(path.stem, text, path.parent))


def include_parts(name: str, text: str, directory: Path) -> str:
    """``text`` with each ``-- @include PART`` line replaced by the lines of
    ``directory/_PART.sql`` but its ``--`` comments, indented as the include line."""
    lines = []
    for line in text.splitlines(keepends=True):
        match = _INCLUDE_LINE.match(line)
        if match is None:
            lines.append(line)
            continue
        indent, part = match[1], directory / f"_{match[2]}.sql"
        if not part.is_file():
            raise QueryParamError(f"{name}: no {part.name} to include")
        body = part.read_text(encoding="utf-8").splitlines()
        lines.extend(f"{indent}{row}\n" for row in body if row and not row.startswith("--"))
    return "".join(lines)


def parse_query(name: str, text: str) -> DashboardQuery:
    header = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        header.append(line)
    if not header:
        raise QueryParamError(f"{name}: the file must start with a -- title line")
    title = header[0].removeprefix("--").strip()
    description: list[str] = []
    declared: dict[str, tuple[str, str]] = {}
    for line in header[1:]:
        match = _PARAM_LINE.match(line)
        if match:
            declared[match[1]] = _default_and_description(name, match[1], match[2])
        else:
            description.append(line.removeprefix("--").strip())
    types = _placeholder_types(name, text)
    if set(types) != set(declared):
        raise QueryParamError(
            f"{name}: placeholders {sorted(types)} but @param lines for {sorted(declared)}"
        )
    params = tuple(Param(param, types[param], *declared[param]) for param in declared)
    return DashboardQuery(name, title, " ".join(description).strip(), text, params)


def _placeholder_types(name: str, text: str) -> dict[str, str]:
    sql = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    types: dict[str, str] = {}
    for match in _PLACEHOLDER.finditer(sql):
        param, type_ = match[1], match[2].strip()
        if types.setdefault(param, type_) != type_:
            raise QueryParamError(f"{name}: {param} is both {types[param]} and {type_}")
    return types


def _default_and_description(name: str, param: str, rest: str) -> tuple[str, str]:
    try:
        value, end = json.JSONDecoder().raw_decode(rest)
    except json.JSONDecodeError:
        raise QueryParamError(f"{name}: the default of {param} is not JSON: {rest!r}") from None
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise QueryParamError(f"{name}: the default of {param} must be a string or a number")
    return str(value), rest[end:].strip()


def main(argv: list[str]) -> None:
    """Prints query ``argv[0]`` whole, its parts included, as a ClickHouse client runs it."""
    if len(argv) != 1:
        sys.exit(
            f"usage: python -m billing.queries NAME (one of: {', '.join(dashboard_queries())})"
        )
    try:
        sys.stdout.write(dashboard_query(argv[0]).sql)
    except QueryParamError as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
