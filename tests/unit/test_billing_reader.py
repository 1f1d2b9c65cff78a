"""Which way ``open_reader`` reaches the data, and what each way returns."""

import asyncio
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from clickhouse_connect.driver.exceptions import DatabaseError

from billing.query_server import create_app, start_query_server
from billing.reader import QueryError, QueryServerReader, StoreReader, open_reader
from billing.storage import Row
from tokenbus.config import Settings
from tokenbus_cli.stack import free_port


class CannedStore:
    """Answers like the sink's read-only client, without opening chdb."""

    def __init__(self) -> None:
        self.queries: list[tuple[str, Mapping[str, Any] | None]] = []

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[Row]:
        self.queries.append((sql, parameters))
        if "boom" in sql:
            raise DatabaseError("Code: 47. DB::Exception: Unknown identifier boom")
        return [{"n": 1}]


@pytest.fixture
def port() -> int:
    return free_port()


async def _serving(dsn: str, port: int, store: CannedStore) -> web.AppRunner:
    return await start_query_server(create_app(store, dsn=dsn), port)


@pytest.fixture
async def owner(tmp_path: Path, port: int) -> AsyncIterator[CannedStore]:
    """A query server claiming tmp_path/ch, as the sink owning it would."""
    store = CannedStore()
    runner = await _serving(f"chdb://{tmp_path / 'ch'}", port, store)
    yield store
    await runner.cleanup()


def _settings(tmp_path: Path, port: int, dsn: str | None = None) -> Settings:
    return Settings(
        home=tmp_path, clickhouse_dsn=dsn or f"chdb://{tmp_path / 'ch'}", billing_query_port=port
    )


async def test_memory_dsn_reads_directly() -> None:
    reader = open_reader(Settings(clickhouse_dsn="chdb://memory", billing_query_port=free_port()))
    try:
        assert isinstance(reader, StoreReader)
        assert reader.query("SELECT count() AS n FROM usage_events") == [{"n": 0}]
    finally:
        reader.close()


async def test_a_directory_nobody_serves_is_opened_directly(tmp_path: Path, port: int) -> None:
    reader = open_reader(_settings(tmp_path, port))
    try:
        assert isinstance(reader, StoreReader)
        # Never used before: migrated on open, so the report finds an empty table.
        assert reader.query("SELECT count() AS n FROM usage_events") == [{"n": 0}]
        with pytest.raises(QueryError, match="UNKNOWN_TABLE"):
            reader.query("SELECT * FROM nope")
    finally:
        reader.close()


async def test_the_owner_of_the_directory_answers_through_its_query_server(
    tmp_path: Path, port: int, owner: CannedStore
) -> None:
    # The reader is synchronous (it serves the CLI): run it beside the server's loop.
    reader = await asyncio.to_thread(open_reader, _settings(tmp_path, port))

    assert isinstance(reader, QueryServerReader)
    rows = await asyncio.to_thread(reader.query, "SELECT {x:UInt8} AS n", {"x": 1})
    assert rows == [{"n": 1}]
    assert owner.queries == [("SELECT {x:UInt8} AS n", {"x": 1})]
    with pytest.raises(QueryError, match="Unknown identifier boom"):
        await asyncio.to_thread(reader.query, "SELECT boom")
    with pytest.raises(QueryError, match="read-only statements"):
        await asyncio.to_thread(reader.query, "DROP TABLE usage_events")
    reader.close()


async def test_a_server_owning_another_directory_is_not_used(tmp_path: Path, port: int) -> None:
    runner = await _serving(f"chdb://{tmp_path / 'elsewhere'}", port, CannedStore())
    try:
        reader = await asyncio.to_thread(open_reader, _settings(tmp_path, port))
        try:
            assert isinstance(reader, StoreReader)
        finally:
            reader.close()
    finally:
        await runner.cleanup()


async def test_an_unreachable_server_dsn_is_a_query_error(tmp_path: Path) -> None:
    settings = _settings(tmp_path, free_port(), dsn=f"http://127.0.0.1:{free_port()}")

    with pytest.raises(QueryError, match=re.escape("cannot open http://127.0.0.1")):
        open_reader(settings)
