"""A batch's input file --> its lines, or the reason the file is refused. Pure.

# JSONL blocks --> check_input (first pass: the file as a whole) --> its number of lines
#   (or InputRefused: not UTF-8, empty, too many lines, duplicate custom_id, endpoints
#    mixed or not the batch's, no line JSON)
# JSONL blocks --> read_input (second pass) --> InputLine per good line + LineError per bad
# InputLine + check_body (injected: the bridge's planner) --> prepare_lines
#   --> PreparedLine | LineError, in line order

File-level problems refuse the whole submission, since no line of such a file can be
trusted to mean what its author meant. A line-level problem (bad JSON on one line, a
wrong method, a bad body, a line longer than a request body may be, a prompt over the
limit, a model the tenant may not use) costs only that line: it becomes an error line
naming its number and the reason, and the rest runs.

Both passes read the file as an iterable of blocks and hold one line at a time (a line
longer than ``max_line_bytes`` is not held at all), so checking a file costs memory in
proportion to its longest line, not to its size; the first pass keeps a 16-byte digest
per ``custom_id``.
"""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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


BodyCheck = Callable[[InputLine], PreparedLine | LineError]
"""Checks one line's body for its tenant (model access, prompt size through the shared
prompt counter, sampling limits) and returns what to run or why not."""


def check_input(
    blocks: Iterable[bytes], endpoint: BatchEndpoint, *, max_lines: int, max_line_bytes: int
) -> int:
    """The number of lines of a file for ``endpoint``, or ``InputRefused`` for the file.

    One refusal, the same whatever the blocks: bytes that are not UTF-8 first (at the
    first such byte), then an empty file, then too many lines, then the first line that
    repeats a ``custom_id`` or names another endpoint, then a file no line of which is
    JSON (a line too long to read counts as one that may be)."""
    num_lines = num_json = num_unread = 0
    refused: InputRefused | None = None
    seen: dict[bytes, int] = {}
    for line_no, text in _nonblank_lines(blocks, max_line_bytes):
        num_lines += 1
        if refused is not None or num_lines > max_lines:
            continue  # refused already: the rest is read for its UTF-8 and its count
        if text is None:
            num_unread += 1
            continue
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError:
            continue
        num_json += 1
        try:
            item = _line(line_no, data, endpoint)
        except InputRefused as exc:
            refused = exc
            continue
        if item.custom_id is not None:
            digest = hashlib.blake2b(item.custom_id.encode(), digest_size=16).digest()
            first = seen.setdefault(digest, line_no)
            if first != line_no:
                refused = InputRefused(
                    "duplicate_custom_id",
                    f"custom_id {item.custom_id!r} appears on lines {first} and "
                    f"{line_no}; each line needs its own",
                )
    if num_lines == 0:
        raise InputRefused("empty_file", "the file holds no lines")
    if num_lines > max_lines:
        raise InputRefused(
            "too_many_lines", f"the file holds {num_lines} lines; at most {max_lines} are accepted"
        )
    if refused is not None:
        raise refused
    if num_json == 0 and num_unread == 0:
        raise InputRefused("invalid_file", "no line of the file is JSON: it is not JSONL")
    return num_lines


def read_input(
    blocks: Iterable[bytes], endpoint: BatchEndpoint, *, max_line_bytes: int
) -> Iterator[InputLine | LineError]:
    """Each line of a file ``check_input`` passed, in order: what it asks, or why not."""
    for line_no, text in _nonblank_lines(blocks, max_line_bytes):
        if text is None:
            yield _error(
                line_no,
                None,
                "body_too_large",
                f"the line has more than {max_line_bytes} bytes, more than a request body may have",
            )
            continue
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            yield _error(line_no, None, "invalid_json", f"not JSON: {exc}")
            continue
        yield _line(line_no, data, endpoint)


def prepare_lines(
    items: Iterable[InputLine | LineError], check_body: BodyCheck
) -> Iterator[PreparedLine | LineError]:
    """Every line checked for its tenant, in the order given: what runs, or why not."""
    for item in items:
        yield item if isinstance(item, LineError) else check_body(item)


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


def _nonblank_lines(
    blocks: Iterable[bytes], max_line_bytes: int
) -> Iterator[tuple[int, str | None]]:
    r"""(line number, text) of each line that is not blank, ``None`` for the text of a
    line longer than ``max_line_bytes`` (which is read through, never held); raises
    ``InputRefused`` at the first byte that is not UTF-8, named by its place in the file.

    Lines end at "\n" only (JSONL): str.splitlines would also split a prompt at the
    Unicode line separators JSON leaves unescaped (U+2028, U+0085 ...). A "\n" byte is
    never part of another character in UTF-8, so splitting the bytes splits the text."""
    line_no, start = 1, 0  # the line being read, and its offset in the file
    pending = bytearray()
    too_long: _LongLine | None = None
    offset = 0
    for block in blocks:
        pos = 0
        while pos < len(block):
            newline = block.find(b"\n", pos)
            end = len(block) if newline < 0 else newline + 1
            piece = block[pos:end]
            if too_long is not None:
                too_long.feed(piece)
            else:
                pending += piece
                if len(pending) - (newline >= 0) > max_line_bytes:
                    too_long = _LongLine(bytes(pending), start)
                    pending.clear()
            pos = end
            if newline >= 0:
                text = _ended(pending, too_long, start)
                if text != "":
                    yield line_no, text
                line_no, start, too_long = line_no + 1, offset + end, None
                pending.clear()
        offset += len(block)
    if pending or too_long is not None:
        text = _ended(pending, too_long, start)
        if text != "":
            yield line_no, text


def _ended(pending: bytearray, too_long: _LongLine | None, start: int) -> str | None:
    r"""A line read whole: its text without "\r\n", "" if blank, None if too long."""
    if too_long is not None:
        return None if too_long.finish() else ""
    try:
        text = pending.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(exc, start) from None
    text = text.removesuffix("\n").removesuffix("\r")
    return text if text.strip() else ""


class _LongLine:
    """A line too long to hold, decoded a piece at a time to find whether it is UTF-8
    and whether it is blank; its text is dropped."""

    def __init__(self, head: bytes, start: int) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._blank = True
        self._at = start  # the file offset of the next byte fed
        self.feed(head)

    def feed(self, piece: bytes, *, final: bool = False) -> None:
        held = len(self._decoder.getstate()[0])  # bytes of a character the last piece cut
        try:
            text = self._decoder.decode(piece, final=final)
        except UnicodeDecodeError as exc:
            raise _not_utf8(exc, self._at - held) from None
        self._at += len(piece)
        self._blank = self._blank and not text.strip()

    def finish(self) -> bool:
        """Whether the line holds anything but whitespace."""
        self.feed(b"", final=True)
        return not self._blank


def _not_utf8(exc: UnicodeDecodeError, at: int) -> InputRefused:
    """Python's message for a bad byte of the whole file, ``at`` its decoded part's offset."""
    start, end = at + exc.start, at + exc.end
    if exc.end - exc.start == 1:
        where = f"byte 0x{exc.object[exc.start]:02x} in position {start}"
    else:
        where = f"bytes in position {start}-{end - 1}"
    message = f"the file is not UTF-8 text: 'utf-8' codec can't decode {where}: {exc.reason}"
    return InputRefused("invalid_file", message)
