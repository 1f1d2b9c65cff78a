"""tokenbus.logs: JSON lines that carry the request they are about."""

from __future__ import annotations

import asyncio
import io
import logging
import logging.config

import orjson
import pytest

from tokenbus.config import Settings
from tokenbus.logs import JsonFormatter, bind_request, logging_config, request_context

Lines = tuple[logging.Logger, io.StringIO]
"""A logger writing JSON lines, and the stream it writes them to."""


@pytest.fixture
def lines() -> Lines:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tokenbus.test_logs")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, stream


def read(stream: io.StringIO) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_is_one_json_object_with_the_request_it_is_about(lines: Lines) -> None:
    logger, stream = lines
    logger.info("outside")
    with request_context(tenant="acme", request_id="r1", session_id="s1", attempt=0):
        logger.info("admitted %s", "r1", extra={"num_tokens": 12})
        with request_context(attempt=1, trace_id="ab" * 16):
            logger.warning("resumed")
        logger.info("back")
    outside, admitted, resumed, back = read(stream)
    assert "tenant" not in outside and outside["message"] == "outside"
    assert admitted["message"] == "admitted r1"
    assert admitted["level"] == "INFO" and admitted["logger"] == "tokenbus.test_logs"
    assert admitted["tenant"] == "acme" and admitted["session_id"] == "s1"
    assert admitted["attempt"] == 0 and admitted["num_tokens"] == 12
    assert str(admitted["ts"]).endswith("+00:00")
    assert resumed["attempt"] == 1 and resumed["trace_id"] == "ab" * 16
    assert resumed["request_id"] == "r1"
    assert back["attempt"] == 0 and "trace_id" not in back


def test_none_fields_are_left_out_and_unknown_ones_refused(lines: Lines) -> None:
    logger, stream = lines
    with request_context(tenant="acme", session_id=None):
        logger.info("x")
    (line,) = read(stream)
    assert "session_id" not in line
    with pytest.raises(ValueError, match="not a log context field: tenant_id"):
        with request_context(tenant_id="acme"):
            pass


def test_tasks_started_inside_keep_the_context(lines: Lines) -> None:
    logger, stream = lines

    async def main() -> None:
        async def later() -> None:
            await asyncio.sleep(0)
            logger.info("in task")

        with request_context(tenant="acme", request_id="r2"):
            task = asyncio.create_task(later())
        logger.info("after")
        await task

    asyncio.run(main())
    after, in_task = read(stream)
    assert "tenant" not in after
    assert in_task["tenant"] == "acme" and in_task["request_id"] == "r2"


def test_exceptions_and_values_json_cannot_hold(lines: Lines) -> None:
    logger, stream = lines
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed", extra={"where": object()})
    (line,) = read(stream)
    assert "RuntimeError: boom" in str(line["exc"])
    assert str(line["where"]).startswith("<object object")


def test_the_dict_config_faust_is_given_writes_json() -> None:
    config = logging_config(Settings(log_format="json"))
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logging.config.dictConfig(config)
    try:
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JsonFormatter)
        text = logging_config(Settings(log_format="text"))
        assert "format" in text["formatters"]["tokenbus"]
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def test_bind_request_holds_for_the_rest_of_its_task_only(lines: Lines) -> None:
    logger, stream = lines

    async def handler(request_id: str) -> None:
        bind_request(tenant="acme", request_id=request_id)
        await asyncio.sleep(0)
        logger.info("streaming")

    async def main() -> None:
        await asyncio.gather(handler("a"), handler("b"))
        logger.info("server")

    asyncio.run(main())
    *streaming, server = read(stream)
    assert sorted(str(line["request_id"]) for line in streaming) == ["a", "b"]
    assert "request_id" not in server
