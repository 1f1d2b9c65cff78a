"""The shared store of input files, output and error files, prepared lines and each
batch's status document, through fsspec: a local directory by default, an object store
(``s3://bucket/prefix``) in production, with one URL setting (``batch_store_url``).

# <root>/<tenant>/files/<file_id>          the file's bytes
# <root>/<tenant>/files/<file_id>.json     its FileDoc
# <root>/<tenant>/batches/<batch_id>.json  its BatchDoc (status, counts, usage)
# <root>/<tenant>/batches/<batch_id>.lines.jsonl   its PreparedLines (runner input)
# <root>/<tenant>/batches/<batch_id>.errors.jsonl  its LineErrors from submit time

Tenant first: every path a caller reaches starts with the tenant it authenticated as,
so a file or batch id of another tenant simply is not found. Ids are checked against
their patterns before they touch a path. Writes are atomic: the bytes go to a temporary
name beside the target, then move over it (a rename on a local disk; on an object store
a single PUT is atomic already), so a reader never sees half a document. A batch's lines
are written as they are checked, never held whole: to temporary names on an object store
too, copied into place once the last is written.
"""

from __future__ import annotations

import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from schemas.batches import (
    BATCH_ID_PATTERN,
    FILE_ID_PATTERN,
    BatchDoc,
    FileDoc,
    LineError,
    PreparedLine,
)
from schemas.messages import TENANT_ID_PATTERN

_TENANT = re.compile(TENANT_ID_PATTERN)
_FILE = re.compile(FILE_ID_PATTERN)
_BATCH = re.compile(BATCH_ID_PATTERN)


class NotFound(KeyError):
    """No such file or batch for this tenant."""


class BatchStore:
    def __init__(self, url: str) -> None:
        fs, root = fsspec.core.url_to_fs(url)
        self._fs = fs
        self._root = root.rstrip("/")
        self._local = isinstance(fs, LocalFileSystem)

    # -- files ------------------------------------------------------------------------
    def put_file(self, doc: FileDoc, data: bytes) -> None:
        self._write(self._file_path(doc.tenant, doc.id), data)
        self._write(self._file_path(doc.tenant, doc.id) + ".json", _json(doc))

    def file_doc(self, tenant: str, file_id: str) -> FileDoc:
        return FileDoc.model_validate_json(self._read(self._file_path(tenant, file_id) + ".json"))

    def put_file_from(self, doc: FileDoc, source: IO[bytes]) -> None:
        """``put_file`` of the bytes ``source`` holds, copied a block at a time."""
        with self._writing(self._file_path(doc.tenant, doc.id)) as f:
            shutil.copyfileobj(source, f)
        self._write(self._file_path(doc.tenant, doc.id) + ".json", _json(doc))

    def file_bytes(self, tenant: str, file_id: str) -> bytes:
        return self._read(self._file_path(tenant, file_id))

    def file_size(self, tenant: str, file_id: str) -> int:
        try:
            num_bytes: int = self._fs.size(self._file_path(tenant, file_id))
        except FileNotFoundError:
            raise NotFound(file_id) from None
        return num_bytes

    def open_file(self, tenant: str, file_id: str) -> IO[bytes]:
        """The file, to read a block at a time rather than whole; the caller closes it."""
        try:
            f: IO[bytes] = self._fs.open(self._file_path(tenant, file_id), "rb")
        except FileNotFoundError:
            raise NotFound(file_id) from None
        return f

    # -- batches ----------------------------------------------------------------------
    def put_batch(self, doc: BatchDoc) -> None:
        self._write(self._batch_path(doc.tenant, doc.id) + ".json", _json(doc))

    def batch(self, tenant: str, batch_id: str) -> BatchDoc:
        return BatchDoc.model_validate_json(
            self._read(self._batch_path(tenant, batch_id) + ".json")
        )

    def batches(self, tenant: str) -> list[BatchDoc]:
        """The tenant's batches, newest first."""
        folder = f"{self._root}/{_checked(_TENANT, tenant, 'tenant')}/batches"
        try:
            names = self._fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        docs = []
        for name in names:
            base = str(name).rsplit("/", 1)[-1]
            if base.endswith(".json") and _BATCH.fullmatch(base[: -len(".json")]):
                try:
                    docs.append(BatchDoc.model_validate_json(self._read(str(name))))
                except (FileNotFoundError, ValueError):
                    continue  # being replaced, or not ours
        return sorted(docs, key=lambda d: (d.created_at, d.id), reverse=True)

    def find_batch(self, batch_id: str) -> BatchDoc:
        """An operator's lookup by id alone (the CLI): searches every tenant."""
        _checked(_BATCH, batch_id, "batch id")
        for path in self._fs.glob(f"{self._root}/*/batches/{batch_id}.json"):
            return BatchDoc.model_validate_json(self._read(str(path)))
        raise NotFound(batch_id)

    @contextmanager
    def line_writer(
        self, tenant: str, batch_id: str
    ) -> Iterator[Callable[[PreparedLine | LineError], None]]:
        """Writes a batch's prepared lines and line errors one at a time, each in the
        order written; both files are in place when the block ends, neither if it raises."""
        base = self._batch_path(tenant, batch_id)
        with (
            self._writing(base + ".lines.jsonl") as lines,
            self._writing(base + ".errors.jsonl") as errors,
        ):

            def write(item: PreparedLine | LineError) -> None:
                (errors if isinstance(item, LineError) else lines).write(_json(item) + b"\n")

            yield write

    def lines(self, tenant: str, batch_id: str) -> list[PreparedLine]:
        raw = self._read(self._batch_path(tenant, batch_id) + ".lines.jsonl")
        return [PreparedLine.model_validate_json(row) for row in raw.splitlines() if row]

    def line_errors(self, tenant: str, batch_id: str) -> list[LineError]:
        raw = self._read(self._batch_path(tenant, batch_id) + ".errors.jsonl")
        return [LineError.model_validate_json(row) for row in raw.splitlines() if row]

    # -- paths and atomic I/O -----------------------------------------------------------
    def _file_path(self, tenant: str, file_id: str) -> str:
        tenant, file_id = _checked(_TENANT, tenant, "tenant"), _checked(_FILE, file_id, "file id")
        return f"{self._root}/{tenant}/files/{file_id}"

    def _batch_path(self, tenant: str, batch_id: str) -> str:
        tenant = _checked(_TENANT, tenant, "tenant")
        return f"{self._root}/{tenant}/batches/{_checked(_BATCH, batch_id, 'batch id')}"

    def _read(self, path: str) -> bytes:
        try:
            with self._fs.open(path, "rb") as f:
                data: bytes = f.read()
                return data
        except FileNotFoundError:
            raise NotFound(path.rsplit("/", 1)[-1]) from None

    def _write(self, path: str, data: bytes) -> None:
        if not self._local:
            self._fs.pipe_file(path, data)  # one PUT: atomic on an object store
            return
        with self._writing(path) as f:
            f.write(data)

    @contextmanager
    def _writing(self, path: str) -> Iterator[IO[bytes]]:
        """A file written a piece at a time under a temporary name, moved to ``path``
        when the block ends (a copy on an object store), removed if it raises."""
        self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        temporary = f"{path}.tmp-{secrets.token_hex(6)}"
        try:
            with self._fs.open(temporary, "wb") as f:
                yield f
            self._fs.mv(temporary, path)
        except BaseException:
            if self._fs.exists(temporary):
                self._fs.rm(temporary)
            raise


def _checked(pattern: re.Pattern[str], value: str, what: str) -> str:
    if not pattern.fullmatch(value):
        raise NotFound(f"{what} {value[:80]!r}")
    return value


def _json(model: FileDoc | BatchDoc | PreparedLine | LineError) -> bytes:
    return model.model_dump_json(exclude_none=False).encode()
