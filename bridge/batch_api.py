"""OpenAI's Files and Batches endpoints, as the ``openai`` client's ``files`` and
``batches`` methods call them: thin handlers over ``tokenbus.batch.store`` and
``tokenbus.batch.submit``.

# POST /v1/files (multipart: file, purpose=batch; one deadline, 413 once past the limit)
#   --> the parser's spool --> store, a block at a time --> FileObject
# GET /v1/files/{id}, GET /v1/files/{id}/content --> store (the caller's tenant only; the
#   content streamed a block at a time)
# POST /v1/batches --> tokenbus.batch.submit.create_batch (every line checked by the planner)
#   --> BatchCommand create --> Batch ; one at a time per tenant (429 while one runs), and
#   at most batch_create_max_inflight_bytes of files at once on the bridge (429 beyond)
# GET /v1/batches[/{id}] --> the status documents ; POST /v1/batches/{id}/cancel --> cancel

Every path in the store starts with the tenant the caller authenticated as: another
tenant's id is answered 404, exactly as an id that does not exist.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import IO, Any

from aiokafka import AIOKafkaProducer
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive

from bridge.admission import Planner
from bridge.auth import Caller
from bridge.batch_lines import BodyChecker
from bridge.byte_budget import ByteBudget
from bridge.errors import (
    ApiError,
    invalid_request,
    rate_limited,
    retry_after,
    too_large,
)
from bridge.gateway import Gateway, ids_of, read_within
from schemas.batches import BatchCredential, BatchDoc
from tokenbus.batch.commands import send_command
from tokenbus.batch.store import BatchStore, NotFound
from tokenbus.batch.submit import BatchRefused, create_batch, file_doc
from tokenbus.config import Settings
from tokenbus.kafka import make_producer

MAX_LIST = 100
FRAMING = 65_536  # a form's bytes beyond its file: boundaries, part headers, purpose
DOWNLOAD_BLOCK_BYTES = 1 << 20  # what a file's download holds at once
BUSY_RETRY_S = 5.0  # a few MiB of lines take about a second to check, a large file tens
log = logging.getLogger(__name__)


class BatchCreateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None


class BatchApi:
    def __init__(self, settings: Settings, gateway: Gateway, planner: Planner) -> None:
        self._settings = settings
        self._gateway = gateway
        self._planner = planner
        self._store = BatchStore(settings.batch_store)
        self._producer: AIOKafkaProducer | None = None
        # Tenants with a create running: checking a file holds a thread and CPU the
        # interactive requests share, so a tenant gets one at a time; and the bytes of
        # the files all tenants' creates are checking, so together they are bounded too.
        self._creating: set[str] = set()
        self._checking = ByteBudget(settings.batch_create_max_inflight_bytes)

    async def start(self) -> None:
        self._producer = make_producer(self._settings)
        await self._producer.start()

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files/{file_id}", self.file, methods=["GET"]),
            Route("/v1/files/{file_id}/content", self.content, methods=["GET"]),
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.list, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
        ]

    # -- files ------------------------------------------------------------------------
    async def upload(self, http: Request) -> Response:
        caller = self._gateway.authenticate(http)
        limit = self._settings.batch_max_file_bytes
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit + FRAMING:
            raise file_too_large(limit)
        if not http.headers.get("content-type", "").startswith("multipart/form-data"):
            raise invalid_request("Send the file as multipart/form-data.", None, "invalid_body")
        form = await self._read_form(http, limit)
        try:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose != "batch":
                raise invalid_request(
                    "purpose must be 'batch': only batch input files are accepted.", "purpose"
                )
            if not isinstance(upload, UploadFile):
                raise invalid_request(
                    "Missing required parameter: file", "file", "missing_required"
                )
            num_bytes = upload.size
            assert num_bytes is not None  # the form parser counts what it spools
            if num_bytes > limit:
                raise file_too_large(limit)
            filename = upload.filename or "upload.jsonl"
            doc = file_doc(caller.tenant_id, filename, num_bytes, time.time())
            # From the parser's spool (on disk past 1 MiB) to the store a block at a time.
            await upload.seek(0)
            await asyncio.to_thread(self._store.put_file_from, doc, upload.file)
        finally:
            await form.close()
        return JSONResponse(doc.public(), headers=ids_of(http))

    async def _read_form(self, http: Request, limit: int) -> FormData:
        """The multipart body under the JSON bodies' rules: one deadline for all of it, so
        a stalled upload is a 408, and a 413 as soon as it passes the file's ``limit``
        and the form's framing, so a body with no Content-Length is not spooled whole
        first."""
        timeout_s = self._settings.batch_upload_timeout_s
        capped = Request(http.scope, _capped(http.receive, limit))
        form = capped.form(max_files=1, max_fields=8)
        return await read_within(http, form, timeout_s, "the file")

    async def file(self, http: Request) -> Response:
        caller = self._gateway.authenticate(http)
        doc = await self._found(self._store.file_doc, caller.tenant_id, http.path_params["file_id"])
        return JSONResponse(doc.public(), headers=ids_of(http))

    async def content(self, http: Request) -> Response:
        caller = self._gateway.authenticate(http)
        tenant, file_id = caller.tenant_id, http.path_params["file_id"]
        num_bytes = await self._found(self._store.file_size, tenant, file_id)
        f = await self._found(self._store.open_file, tenant, file_id)
        headers = {**ids_of(http), "Content-Length": str(num_bytes)}
        return StreamingResponse(
            _read_blocks(f), media_type="application/octet-stream", headers=headers
        )

    # -- batches ----------------------------------------------------------------------
    async def create(self, http: Request) -> Response:
        caller = self._gateway.authenticate(http)
        body = await self._gateway.read_body(http, BatchCreateBody)
        if caller.tenant_id in self._creating:
            raise rate_limited(
                "Another batch of your tenant is being created; retry when it is.",
                "batch_create_in_progress",
                retry_after(1.0),
            )
        self._creating.add(caller.tenant_id)
        work = asyncio.ensure_future(self._create(caller, body))

        def release(done: asyncio.Future[BatchDoc]) -> None:
            # When the thread ends, not when the client leaves: a client that leaves
            # cannot start another beside it. A refusal no one awaits any more is read.
            self._creating.discard(caller.tenant_id)
            if not done.cancelled():
                done.exception()

        work.add_done_callback(release)
        doc = await asyncio.shield(work)
        if not doc.is_terminal:
            assert self._producer is not None
            await send_command(self._producer, self._settings, "create", doc.tenant, doc.id)
        return JSONResponse(_public(doc), headers=ids_of(http))

    async def _create(self, caller: Caller, body: BatchCreateBody) -> BatchDoc:
        num_bytes = await self._input_bytes(caller.tenant_id, body.input_file_id)
        if not self._checking.try_take(num_bytes):
            raise rate_limited(
                "The bridge is checking as many batch files as it can at once; retry shortly.",
                "batch_create_busy",
                retry_after(BUSY_RETRY_S),
            )
        try:
            return await asyncio.to_thread(
                create_batch,
                self._store,
                self._settings,
                tenant=caller.tenant_id,
                input_file_id=body.input_file_id,
                endpoint=body.endpoint,
                completion_window=body.completion_window,
                metadata=body.metadata,
                check_body=BodyChecker(self._planner, caller),
                now=time.time(),
                credential=BatchCredential(
                    key_sha256=caller.key_sha256, quota_balance=caller.quota_balance
                ),
            )
        except BatchRefused as exc:
            type_ = "invalid_request_error"
            raise ApiError(
                exc.status, exc.message, type=type_, code=exc.code, param=exc.param
            ) from None
        finally:
            self._checking.give_back(num_bytes)

    async def _input_bytes(self, tenant: str, file_id: str) -> int:
        """The size of the file a create names, 0 if there is none (``create_batch``
        answers that)."""
        try:
            doc = await asyncio.to_thread(self._store.file_doc, tenant, file_id)
        except NotFound:
            return 0
        return doc.bytes

    async def retrieve(self, http: Request) -> Response:
        caller = self._gateway.authenticate(http)
        doc = await self._batch(caller.tenant_id, http.path_params["batch_id"])
        return JSONResponse(_public(doc), headers=ids_of(http))

    async def list(self, http: Request) -> Response:
        caller = self._gateway.authenticate(http)
        try:
            limit = int(http.query_params.get("limit", "20"))
        except ValueError:
            raise invalid_request("limit must be an integer.", "limit") from None
        if not 1 <= limit <= MAX_LIST:
            raise invalid_request(f"limit must be between 1 and {MAX_LIST}.", "limit")
        docs = await asyncio.to_thread(self._store.batches, caller.tenant_id)
        after = http.query_params.get("after")
        if after is not None:
            ids = [d.id for d in docs]
            docs = docs[ids.index(after) + 1 :] if after in ids else []
        page = docs[:limit]
        body = {
            "object": "list",
            "data": [_public(d) for d in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": len(docs) > limit,
        }
        return JSONResponse(body, headers=ids_of(http))

    async def cancel(self, http: Request) -> Response:
        caller = self._gateway.authenticate(http)
        doc = await self._batch(caller.tenant_id, http.path_params["batch_id"])
        if doc.is_terminal:
            raise ApiError(
                409,
                f"The batch is {doc.status}; only a running batch can be cancelled.",
                type="invalid_request_error",
                code="batch_not_cancellable",
            )
        assert self._producer is not None
        await send_command(self._producer, self._settings, "cancel", doc.tenant, doc.id)
        # The runner records the cancel; the answer says what the caller asked for.
        if doc.status != "cancelling":
            doc.status = "cancelling"
            doc.cancelling_at = int(time.time())
        return JSONResponse(_public(doc), headers=ids_of(http))

    # -- lookups --------------------------------------------------------------------------
    async def _batch(self, tenant: str, batch_id: str) -> BatchDoc:
        doc: BatchDoc = await self._found(self._store.batch, tenant, batch_id)
        return doc

    async def _found(self, read: Any, tenant: str, item_id: str) -> Any:
        try:
            return await asyncio.to_thread(read, tenant, item_id)
        except NotFound:
            raise ApiError(
                404,
                f"No such object: {item_id[:80]!r}.",
                type="invalid_request_error",
                code="not_found",
            ) from None


def file_too_large(limit: int) -> ApiError:
    return too_large(f"The file exceeds {limit} bytes.", "file", "file_too_large")


async def _read_blocks(f: IO[bytes]) -> AsyncIterator[bytes]:
    """``f`` a block at a time, each read in a thread, then closed."""
    try:
        while block := await asyncio.to_thread(f.read, DOWNLOAD_BLOCK_BYTES):
            yield block
    finally:
        f.close()


def _capped(receive: Receive, limit: int) -> Receive:
    """``receive``, refusing the body once it is more than a ``limit``-byte file's form."""
    num_bytes = 0

    async def capped() -> Message:
        nonlocal num_bytes
        message = await receive()
        num_bytes += len(message.get("body", b""))
        if num_bytes > limit + FRAMING:
            raise file_too_large(limit)
        return message

    return capped


def _public(doc: BatchDoc) -> dict[str, Any]:
    return doc.model_dump(mode="json", exclude={"credential"})
