"""Which SQL the loopback query server accepts: one read-only statement.

ClickHouse's ``readonly=1``, set on the server's client, is the main guard: it binds
every statement, and refuses writes, DDL, settings changes and file()/url(). This
check adds what it does not cover, and clear 400s for the rest:

- ``INTO OUTFILE``: chdb writes that file even under ``readonly=1``;
- more than one statement: chdb runs them all and, when one fails, leaks the earlier
  results into the next query on that handle.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

READ_ONLY_KEYWORDS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC"})


def read_only_problem(sql: str) -> str | None:
    """None if ``sql`` is one statement starting with a read-only keyword, else why not."""
    tokens = list(_tokens(sql))
    if not tokens:
        return "empty query"
    first = tokens[0].upper()
    if first not in READ_ONLY_KEYWORDS:
        allowed = "/".join(sorted(READ_ONLY_KEYWORDS))
        return f"only read-only statements ({allowed}) are accepted, not {first[:20]}"
    if ";" in tokens[:-1]:
        return "only one statement per request is accepted"
    words = [token.upper() for token in tokens]
    if any(a == "INTO" and b == "OUTFILE" for a, b in itertools.pairwise(words)):
        return "INTO OUTFILE is not accepted"
    return None


def _tokens(sql: str) -> Iterator[str]:
    """Bare words and single characters, skipping whitespace, comments and literals."""
    i = 0
    while i < len(sql):
        char = sql[i]
        if char.isspace():
            i += 1
        elif sql.startswith(("--", "#"), i):
            newline = sql.find("\n", i)
            i = len(sql) if newline < 0 else newline + 1
        elif sql.startswith("/*", i):
            close = sql.find("*/", i + 2)
            i = len(sql) if close < 0 else close + 2
        elif char in "'\"`":
            end = _end_of_quoted(sql, i)
            yield sql[i:end]
            i = end
        elif char.isalnum() or char == "_":
            start = i
            while i < len(sql) and (sql[i].isalnum() or sql[i] == "_"):
                i += 1
            yield sql[start:i]
        else:
            yield char
            i += 1


def _end_of_quoted(sql: str, i: int) -> int:
    quote = sql[i]
    i += 1
    while i < len(sql):
        if sql[i] == "\\":
            i += 2
        elif sql.startswith(quote * 2, i):  # a doubled quote is an escaped quote
            i += 2
        elif sql[i] == quote:
            return i + 1
        else:
            i += 1
    return i
