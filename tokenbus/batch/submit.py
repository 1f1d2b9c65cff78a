"""Creating a batch, as the bridge's ``POST /v1/batches`` and ``tokenbus batch submit``
both do it: check everything the client set, record the batch, tell the runners.

# input file (store, read a block at a time) + endpoint + completion_window + metadata
# --> tokenbus.batch.lines: check_input (file refused, or its number of lines)
# --> read_input + prepare_lines (BodyCheck) --> store, a line at a time (lines, errors)
# --> BatchDoc (store) --> BatchCommand create --> <prefix>.batches

The file is read twice, never held: once to refuse it whole or count its lines, once to
check and write each line. The status document is written after the lines and before
the command, so a runner that reads the command always finds both. A batch none of
whose lines can run is ``failed`` at once, with every line's reason in its ``errors``;
the runner skips it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO

from schemas.batches import (
    BatchCredential,
    BatchDoc,
    BatchEndpoint,
    BatchErrorItem,
    BatchErrors,
    FileDoc,
    LineError,
    RequestCounts,
)
from tokenbus.batch.lines import BodyCheck, InputRefused, check_input, prepare_lines, read_input
from tokenbus.batch.store import BatchStore, NotFound
from tokenbus.config import Settings
from tokenbus.errors import CodedError
from tokenbus.ids import ulid

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_DOC_ERRORS = 1_000
"""Line errors listed in the status document; the error file has them all."""
READ_BLOCK_BYTES = 1 << 20
"""How much of an input file is read at once."""
LINE_FRAMING_BYTES = 8192
"""A line's bytes around its body: ``custom_id`` (512 characters, 6 KiB escaped),
``method`` and ``url``. A line longer than ``bridge_max_body_bytes`` and this is refused
as the bridge refuses such a body sent alone (``body_too_large``), and never held."""


WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")


def parse_window(text: str, *, min_s: float, max_s: float) -> float:
    """``completion_window`` in seconds: OpenAI's ``24h``, or e.g. ``90s``, ``30m``."""
    match = _WINDOW.fullmatch(text)
    if match is None:
        raise ValueError(
            f"completion_window {text[:32]!r} is not a duration such as '24h', '30m' or '90s'"
        )
    seconds = int(match.group(1)) * WINDOW_UNITS[match.group(2)]
    if not min_s <= seconds <= max_s:
        raise ValueError(f"completion_window {text!r} must be between {min_s:g} s and {max_s:g} s")
    return float(seconds)


class BatchRefused(CodedError, ValueError):
    """The batch cannot be created: ``status`` as the API answers it, a code, a message."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(code, message)
        self.status = status
        self.param = param


def new_file_id() -> str:
    return f"file-{ulid()}"


def new_batch_id() -> str:
    return f"batch_{ulid()}"


def check_metadata(metadata: object) -> dict[str, str] | None:
    """OpenAI's rules: at most 16 pairs of strings, keys to 64 and values to 512 chars."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise BatchRefused(
            400, "invalid_metadata", "metadata must map strings to strings", "metadata"
        )
    if len(metadata) > MAX_METADATA_KEYS:
        raise BatchRefused(
            400, "invalid_metadata", f"metadata holds at most {MAX_METADATA_KEYS} keys", "metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise BatchRefused(
                400,
                "invalid_metadata",
                f"metadata keys have at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"at most {MAX_METADATA_VALUE_CHARS}",
                "metadata",
            )
    return dict(metadata)


def create_batch(
    store: BatchStore,
    settings: Settings,
    *,
    tenant: str,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: object,
    check_body: BodyCheck,
    now: float,
    credential: BatchCredential | None = None,
) -> BatchDoc:
    """Checks and records a batch (blocking I/O: call it in a thread)."""
    if endpoint not in ("/v1/chat/completions", "/v1/completions"):
        raise BatchRefused(
            400,
            "invalid_endpoint",
            "endpoint must be /v1/chat/completions or /v1/completions",
            "endpoint",
        )
    batch_endpoint: BatchEndpoint = endpoint  # type: ignore[assignment]
    try:
        window_s = parse_window(
            completion_window, min_s=settings.batch_min_window_s, max_s=settings.batch_max_window_s
        )
    except ValueError as exc:
        raise BatchRefused(
            400, "invalid_completion_window", str(exc), "completion_window"
        ) from None
    checked_metadata = check_metadata(metadata)
    try:
        file_doc = store.file_doc(tenant, input_file_id)
    except NotFound:
        raise _no_file(input_file_id) from None
    if file_doc.purpose != "batch":
        raise BatchRefused(
            400, "invalid_file", "the input file must have been uploaded with purpose 'batch'",
            "input_file_id",
        )  # fmt: skip
    batch_id = new_batch_id()
    max_line_bytes = settings.bridge_max_body_bytes + LINE_FRAMING_BYTES
    num_prepared, model = 0, None
    errors: list[LineError] = []  # the first MAX_DOC_ERRORS, for the status document
    try:
        with store.open_file(tenant, input_file_id) as f:
            num_lines = check_input(
                _blocks(f),
                batch_endpoint,
                max_lines=settings.batch_max_lines,
                max_line_bytes=max_line_bytes,
            )
            f.seek(0)
            items = read_input(_blocks(f), batch_endpoint, max_line_bytes=max_line_bytes)
            with store.line_writer(tenant, batch_id) as write:
                for line in prepare_lines(items, check_body):
                    write(line)
                    if isinstance(line, LineError):
                        if len(errors) < MAX_DOC_ERRORS:
                            errors.append(line)
                    else:
                        num_prepared += 1
                        model = model or line.model
    except NotFound:
        raise _no_file(input_file_id) from None
    except InputRefused as exc:
        raise BatchRefused(400, exc.code, exc.message, "input_file_id") from None
    created = int(now)
    doc = BatchDoc(
        id=batch_id,
        endpoint=batch_endpoint,
        input_file_id=input_file_id,
        completion_window=completion_window,
        status="validating" if num_prepared else "failed",
        created_at=created,
        expires_at=created + int(window_s),
        failed_at=None if num_prepared else created,
        request_counts=RequestCounts(
            total=num_lines, completed=0, failed=0 if num_prepared else num_lines
        ),
        metadata=checked_metadata,
        errors=_doc_errors(errors),
        model=model,
        tenant=tenant,
        credential=credential,
    )
    store.put_batch(doc)
    return doc


def _blocks(f: IO[bytes]) -> Iterator[bytes]:
    while block := f.read(READ_BLOCK_BYTES):
        yield block


def _no_file(input_file_id: str) -> BatchRefused:
    return BatchRefused(
        404, "file_not_found", f"No file {input_file_id[:80]!r} of yours.", "input_file_id"
    )


def _doc_errors(errors: list[LineError]) -> BatchErrors | None:
    """The first ``MAX_DOC_ERRORS`` line errors, as the status document lists them."""
    if not errors:
        return None
    return BatchErrors(
        data=[
            BatchErrorItem(
                code=e.code,
                message=e.message,
                line=e.line_no,
                param=f"custom_id={e.custom_id}" if e.custom_id else None,
            )
            for e in errors[:MAX_DOC_ERRORS]
        ]
    )


def file_doc(tenant: str, filename: str, num_bytes: int, now: float) -> FileDoc:
    """The record of an uploaded input file of ``num_bytes``; the name is the client's,
    kept only as a label."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1][:256] or "upload.jsonl"
    return FileDoc(
        id=new_file_id(),
        bytes=num_bytes,
        created_at=int(now),
        filename=name,
        purpose="batch",
        tenant=tenant,
    )
