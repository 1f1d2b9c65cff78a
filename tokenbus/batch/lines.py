"""A batch's input file --> its lines, or the reason the file is refused. Pure.

# JSONL bytes --> parse_input --> InputLine per good line + LineError per bad line
# (or InputRefused: not JSONL at all, empty, too many lines, duplicate custom_id,
#  endpoints mixed or not the batch's)
# InputLine + check_body (injected: the bridge's planner) --> PreparedLine | LineError

File-level problems refuse the whole submission, since no line of such a file can be
trusted to mean what its author meant. A line-level problem (bad JSON on one line, a
wrong method, a bad body, a prompt over the limit, a model the tenant may not use)
costs only that line: it becomes an error line naming its number and the reason, and
the rest runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from schemas.batches import BatchEndpoint, LineError, PreparedLine
from tokenbus.errors import CodedError

ENDPOINTS: tuple[BatchEndpoint, ...] = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID_CHARS = 512
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


class InputRefused(CodedError, ValueError):
    """The file as a whole is refused: ``code`` and a message a person can act on."""


@dataclass(frozen=True)
class InputLine:
    line_no: int
    custom_id: str
    url: BatchEndpoint
    body: dict[str, Any]


@dataclass
class ParsedInput:
    lines: list[InputLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)

    @property
    def num_lines(self) -> int:
        return len(self.lines) + len(self.errors)


BodyCheck = Callable[[InputLine], PreparedLine | LineError]
"""Checks one line's body for its tenant (model access, prompt size through the shared
prompt counter, sampling limits) and returns what to run or why not."""


def parse_input(raw: bytes, endpoint: BatchEndpoint, *, max_lines: int) -> ParsedInput:
    """The lines of a batch for ``endpoint``; raises ``InputRefused`` for the file."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputRefused("invalid_file", f"the file is not UTF-8 text: {exc}") from None
    # Lines end at "\n" only (JSONL): str.splitlines would also split a prompt at the
    # Unicode line separators JSON leaves unescaped (U+2028, U+0085 ...).
    numbered = enumerate((line.removesuffix("\r") for line in text.split("\n")), start=1)
    rows = [(n, line) for n, line in numbered if line.strip()]
    if not rows:
        raise InputRefused("empty_file", "the file holds no lines")
    if len(rows) > max_lines:
        raise InputRefused(
            "too_many_lines", f"the file holds {len(rows)} lines; at most {max_lines} are accepted"
        )
    parsed = ParsedInput()
    seen: dict[str, int] = {}
    num_json = 0
    for line_no, line in rows:
        try:
            data = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            parsed.errors.append(_error(line_no, None, "invalid_json", f"not JSON: {exc}"))
            continue
        num_json += 1
        item = _line(line_no, data, endpoint)
        custom_id = item.custom_id
        if custom_id is not None:
            if custom_id in seen:
                raise InputRefused(
                    "duplicate_custom_id",
                    f"custom_id {custom_id!r} appears on lines {seen[custom_id]} and "
                    f"{line_no}; each line needs its own",
                )
            seen[custom_id] = line_no
        if isinstance(item, LineError):
            parsed.errors.append(item)
        else:
            parsed.lines.append(item)
    if num_json == 0:
        raise InputRefused("invalid_file", "no line of the file is JSON: it is not JSONL")
    return parsed


def prepare(
    parsed: ParsedInput, check_body: BodyCheck
) -> tuple[list[PreparedLine], list[LineError]]:
    """Every line checked for its tenant: what runs, and every line that will not."""
    prepared: list[PreparedLine] = []
    errors = list(parsed.errors)
    for line in parsed.lines:
        result = check_body(line)
        if isinstance(result, LineError):
            errors.append(result)
        else:
            prepared.append(result)
    errors.sort(key=lambda e: e.line_no)
    return prepared, errors


def _line(line_no: int, data: Any, endpoint: BatchEndpoint) -> InputLine | LineError:
    if not isinstance(data, dict):
        return _error(line_no, None, "invalid_line", "a line must be a JSON object")
    raw_id = data.get("custom_id")
    custom_id = raw_id if isinstance(raw_id, str) else None
    if custom_id is None:
        return _error(line_no, None, "missing_custom_id", "custom_id must be a string")
    if not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return _error(
            line_no,
            None,
            "invalid_custom_id",
            f"custom_id must have 1 to {MAX_CUSTOM_ID_CHARS} characters",
        )
    unknown = sorted(set(data) - LINE_KEYS)
    if unknown:
        return _error(line_no, custom_id, "invalid_line", f"unknown fields: {', '.join(unknown)}")
    if data.get("method") != "POST":
        return _error(line_no, custom_id, "invalid_method", "method must be 'POST'")
    url = data.get("url")
    if url not in ENDPOINTS:
        return _error(
            line_no, custom_id, "invalid_url", f"url must be one of {', '.join(ENDPOINTS)}"
        )
    if url != endpoint:
        raise InputRefused(
            "mismatched_endpoint",
            f"line {line_no} is for {url}, the batch for {endpoint}: a batch has one endpoint",
        )
    body = data.get("body")
    if not isinstance(body, dict):
        return _error(line_no, custom_id, "invalid_body", "body must be a JSON object")
    if body.get("stream"):
        return _error(line_no, custom_id, "invalid_body", "stream is not allowed in a batch")
    return InputLine(line_no, custom_id, endpoint, body)


def _error(line_no: int, custom_id: str | None, code: str, message: str) -> LineError:
    return LineError(line_no=line_no, custom_id=custom_id, code=code, message=message)
