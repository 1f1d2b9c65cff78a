from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from schemas import SamplingParams
from schemas.batches import BatchEndpoint, LineError, PreparedLine
from tokenbus.batch.lines import (
    BodyCheck,
    InputLine,
    InputRefused,
    check_input,
    prepare_lines,
    read_input,
)

CHAT: BatchEndpoint = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **body: object) -> str:
    body = body or {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def jsonl(*rows: str) -> bytes:
    return ("\n".join(rows) + "\n").encode()


@dataclass
class Parsed:
    lines: list[InputLine] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    num_lines: int = 0


def parse_input(raw: bytes, endpoint: BatchEndpoint, *, max_lines: int) -> Parsed:
    """Both passes over a file held whole, as one block."""
    max_line_bytes = max(len(raw), 1)
    parsed = Parsed()
    parsed.num_lines = check_input(
        [raw], endpoint, max_lines=max_lines, max_line_bytes=max_line_bytes
    )
    for item in read_input([raw], endpoint, max_line_bytes=max_line_bytes):
        if isinstance(item, LineError):
            parsed.errors.append(item)
        else:
            parsed.lines.append(item)
    return parsed


def prepare(parsed: Parsed, check_body: BodyCheck) -> tuple[list[PreparedLine], list[LineError]]:
    """``prepare_lines`` over a parsed file, in line order: what runs, and what will not."""
    in_order: list[InputLine | LineError] = [*parsed.lines, *parsed.errors]
    in_order.sort(key=lambda item: item.line_no)
    prepared: list[PreparedLine] = []
    errors: list[LineError] = []
    for result in prepare_lines(in_order, check_body):
        if isinstance(result, LineError):
            errors.append(result)
        else:
            prepared.append(result)
    return prepared, errors


def test_good_lines_parse_with_their_numbers() -> None:
    parsed = parse_input(jsonl(line("a"), "", line("b")), CHAT, max_lines=10)
    assert [(x.line_no, x.custom_id) for x in parsed.lines] == [(1, "a"), (3, "b")]
    assert parsed.errors == []
    assert parsed.num_lines == 2


def test_a_malformed_line_is_an_error_naming_its_number_and_the_rest_runs() -> None:
    raw = jsonl(line("a"), "{not json", line("c"), '["a list"]', json.dumps({"custom_id": "e"}))
    parsed = parse_input(raw, CHAT, max_lines=10)
    assert [x.custom_id for x in parsed.lines] == ["a", "c"]
    assert [(e.line_no, e.code) for e in parsed.errors] == [
        (2, "invalid_json"),
        (4, "invalid_line"),
        (5, "invalid_method"),
    ]
    assert "not JSON" in parsed.errors[0].message


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "empty_file"),
        (b"\n  \n", "empty_file"),
        (b"\xff\xfe binary", "invalid_file"),
        (b"hello, world\nthis is a CSV\n", "invalid_file"),
        (jsonl(line("a"), line("a")), "duplicate_custom_id"),
        (
            jsonl(line("a"), line("b", url="/v1/completions", model="m", prompt="p")),
            "mismatched_endpoint",
        ),
        (jsonl(*(line(str(n)) for n in range(4))), "too_many_lines"),
    ],
)
def test_a_file_that_cannot_be_trusted_is_refused_whole(raw: bytes, code: str) -> None:
    with pytest.raises(InputRefused) as refused:
        parse_input(raw, CHAT, max_lines=3)
    assert refused.value.code == code


def test_the_duplicate_names_both_lines() -> None:
    with pytest.raises(InputRefused, match="lines 1 and 3"):
        parse_input(jsonl(line("x"), line("y"), line("x")), CHAT, max_lines=10)


@pytest.mark.parametrize(
    ("row", "code"),
    [
        (
            json.dumps({"custom_id": 7, "method": "POST", "url": CHAT, "body": {}}),
            "missing_custom_id",
        ),
        (
            json.dumps({"custom_id": "", "method": "POST", "url": CHAT, "body": {}}),
            "invalid_custom_id",
        ),
        (
            json.dumps({"custom_id": "x" * 513, "method": "POST", "url": CHAT, "body": {}}),
            "invalid_custom_id",
        ),
        (
            json.dumps({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}),
            "invalid_method",
        ),
        (
            json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}),
            "invalid_url",
        ),
        (json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": []}), "invalid_body"),
        (
            json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": {"stream": True}}),
            "invalid_body",
        ),
        (
            json.dumps(
                {"custom_id": "a", "method": "POST", "url": CHAT, "body": {}, "batch_id": "b"}
            ),
            "invalid_line",
        ),
    ],
)
def test_each_bad_field_of_a_line_is_named(row: str, code: str) -> None:
    parsed = parse_input(jsonl(line("ok"), row), CHAT, max_lines=10)
    assert [e.code for e in parsed.errors] == [code]
    assert parsed.errors[0].line_no == 2


def test_prepare_applies_the_body_check_and_keeps_errors_in_line_order() -> None:
    parsed = parse_input(jsonl(line("a"), "nope", line("c")), CHAT, max_lines=10)

    def check(item: InputLine) -> PreparedLine | LineError:
        if item.custom_id == "a":
            return LineError(
                line_no=item.line_no, custom_id="a", code="model_not_allowed", message="no"
            )
        return PreparedLine(
            line_no=item.line_no,
            custom_id=item.custom_id,
            model="tiny-llama",
            prompt="p",
            sampling=SamplingParams(max_tokens=2),
        )

    prepared, errors = prepare(parsed, check)
    assert [p.custom_id for p in prepared] == ["c"]
    assert [(e.line_no, e.code) for e in errors] == [(1, "model_not_allowed"), (2, "invalid_json")]


def test_lines_end_at_newlines_only() -> None:
    row = json.dumps(
        {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"prompt": "x\u2028y\x85z"}},
        ensure_ascii=False,
    )
    parsed = parse_input((row + "\r\n" + line("b")).encode(), CHAT, max_lines=10)
    assert [x.custom_id for x in parsed.lines] == ["a", "b"]
    assert parsed.lines[0].body["prompt"] == "x\u2028y\x85z"


def blocks_of(raw: bytes, size: int) -> list[bytes]:
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def test_blocks_of_any_size_read_the_same_lines() -> None:
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "é\u2028😀 y"}]}
    rows = [
        json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": chat}),
        "\u3000 ",  # blank: Unicode whitespace only
        json.dumps(
            {"custom_id": "b", "method": "POST", "url": CHAT, "body": chat}, ensure_ascii=False
        ),
        "{broken",
        line("c"),
    ]
    raw = ("\r\n".join(rows[:3]) + "\n\n" + "\n".join(rows[3:])).encode()  # no final "\n"
    whole = list(read_input([raw], CHAT, max_line_bytes=len(raw)))
    assert [(x.line_no, x.custom_id) for x in whole] == [(1, "a"), (3, "b"), (5, None), (6, "c")]
    assert isinstance(whole[1], InputLine) and whole[1].body == chat
    for size in (1, 2, 3, 5, 64):
        blocks = blocks_of(raw, size)
        assert check_input(blocks, CHAT, max_lines=10, max_line_bytes=len(raw)) == 4
        assert list(read_input(blocks, CHAT, max_line_bytes=len(raw))) == whole


@pytest.mark.parametrize("bad", [b"\xff", b"\xe2\x82", b"\xf0\x9f\x98"])
def test_bytes_that_are_not_utf8_are_named_by_their_place_in_the_file(bad: bytes) -> None:
    raw = jsonl(line("a"), "😀" * 40) + line("b").encode()[:20] + bad + b"\n" + jsonl(line("c"))
    with pytest.raises(UnicodeDecodeError) as decoding:
        raw.decode("utf-8")
    expected = f"the file is not UTF-8 text: {decoding.value}"  # as the whole file decoded
    for size in (1, 3, 7, len(raw)):
        for max_line_bytes in (8, len(raw)):  # a line held, and one read through
            with pytest.raises(InputRefused) as refused:
                check_input(blocks_of(raw, size), CHAT, max_lines=10, max_line_bytes=max_line_bytes)
            assert (refused.value.code, refused.value.message) == ("invalid_file", expected)


def test_a_line_longer_than_a_request_body_is_that_line_s_error() -> None:
    long = line("long", model="tiny-llama", messages=[{"role": "user", "content": "x" * 5000}])
    raw = jsonl(line("a"), long, " " * 5000, line("b"))
    for size in (7, len(raw)):
        blocks = blocks_of(raw, size)
        assert check_input(blocks, CHAT, max_lines=10, max_line_bytes=1000) == 3
        items = list(read_input(blocks, CHAT, max_line_bytes=1000))
        assert [(x.line_no, x.custom_id) for x in items] == [(1, "a"), (2, None), (4, "b")]
        assert isinstance(items[1], LineError) and items[1].code == "body_too_large"
    only_long = jsonl(long, long.replace("long", "other"))
    # Its JSON unread, so a file of such lines is not refused as "not JSONL".
    assert check_input([only_long], CHAT, max_lines=10, max_line_bytes=1000) == 2
