"""Applies ``billing/migrations/NNN_name.sql`` in order, each once per database.

Applied versions are recorded in ``schema_migrations``. Every statement in a migration
is idempotent (``CREATE ... IF NOT EXISTS``), so two processes migrating at once, or a
crash between a migration and its record, only repeat harmless work.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources

from clickhouse_connect.driver.client import Client

log = logging.getLogger(__name__)

_FILE_NAME = re.compile(r"^(\d+)_([\w-]+)\.sql$")
# A statement ends with ';' at the end of a line; migrations keep ';' out of literals.
_STATEMENT_END = re.compile(r";[ \t]*(?:\r?\n|$)")

_CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations
(
    version    UInt32,
    name       String,
    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
ORDER BY version
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def statements(self) -> list[str]:
        chunks = (chunk.strip() for chunk in _STATEMENT_END.split(self.sql))
        return [chunk for chunk in chunks if chunk and not _only_comments(chunk)]


def bundled_migrations() -> list[Migration]:
    """The migrations shipped in this package, ordered by version."""
    found = []
    for entry in resources.files("billing").joinpath("migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"two migrations share a version: {versions}")
    return found


def apply_migrations(client: Client, migrations: list[Migration] | None = None) -> list[int]:
    """Applies the migrations not yet recorded; returns the versions applied now."""
    client.command(_CREATE_LEDGER)
    done = {row[0] for row in client.query("SELECT version FROM schema_migrations").result_rows}
    applied = []
    for migration in migrations if migrations is not None else bundled_migrations():
        if migration.version in done:
            continue
        for statement in migration.statements:
            client.command(statement)
        client.insert(
            "schema_migrations",
            [[migration.version, migration.name]],
            column_names=["version", "name"],
        )
        log.info("applied migration %03d_%s", migration.version, migration.name)
        applied.append(migration.version)
    return applied


def _only_comments(chunk: str) -> bool:
    return all(not line.strip() or line.strip().startswith("--") for line in chunk.splitlines())
