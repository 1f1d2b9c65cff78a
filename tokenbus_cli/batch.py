"""``tokenbus batch``: the Kafka-native batch shape, for operators and programs beside the
cluster (they share its store and its bus, like the bridge).

# submit FILE --tenant T --> checked as the bridge checks it (tokenbus.batch.submit) --> store
#   --> BatchCommand create --> a progress bar over the batch's status document
# status ID / results ID / cancel ID --> the store (and, for cancel, the commands topic)
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import click

from tokenbus.config import Settings

if TYPE_CHECKING:
    from schemas.batches import BatchDoc
    from tokenbus.batch.store import BatchStore


def _settings() -> Settings:
    from tokenbus_cli.stack import bundled_broker_profile

    settings = bundled_broker_profile(Settings())
    written = settings.home / "tenants.toml"  # the local stack's, when none is configured
    if settings.tenants_file is None and written.exists():
        settings = settings.model_copy(update={"tenants_file": written})
    return settings


@click.group()
def batch() -> None:
    """Batch jobs: submit a JSONL of requests, follow it, collect every result once."""


@batch.command()
@click.argument("path", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--tenant", required=True, help="The tenant the batch runs (and is billed) for.")
@click.option(
    "--endpoint",
    type=click.Choice(["/v1/chat/completions", "/v1/completions"]),
    default=None,
    help="Default: the url of the file's first line.",
)
@click.option("--window", default="24h", show_default=True, help="completion_window: 24h, 30m ...")
@click.option("--metadata", "pairs", multiple=True, help="key=value, repeatable.")
@click.option("--no-wait", is_flag=True, help="Print the batch id and return at once.")
def submit(
    path: Path,
    tenant: str,
    endpoint: str | None,
    window: str,
    pairs: tuple[str, ...],
    no_wait: bool,
) -> None:
    """Submit PATH (JSONL: custom_id, method, url, body per line) as one batch."""
    from bridge.admission import Planner
    from bridge.auth import Caller
    from bridge.batch_lines import BodyChecker
    from bridge.hygiene import PatternScreen
    from tokenbus.batch.store import BatchStore
    from tokenbus.batch.submit import BatchRefused, create_batch, file_doc
    from tokenbus.prompt_tokens import PromptCounter

    metadata: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint="--metadata")
        metadata[key] = value
    settings = _settings()
    directory = settings.tenant_directory()
    if tenant not in directory and not settings.allow_unlisted_tenants:
        raise click.ClickException(f"tenant {tenant!r} is not in the tenants file")
    data = path.read_bytes()
    if len(data) > settings.batch_max_file_bytes:
        raise click.ClickException(f"{path} exceeds {settings.batch_max_file_bytes} bytes")
    known = {settings.served_model_name, *settings.bridge_models}
    planner = Planner(
        PatternScreen.create(
            settings.bridge_injection_patterns, settings.bridge_sensitive_patterns
        ),
        PromptCounter.from_model_dir(settings.model_dir),
        max_prompt_chars=settings.bridge_max_prompt_chars,
        knows_model=lambda model: model in known or ":" in model,
    )
    caller = Caller(tenant=directory.get(tenant), credential_id="cli", reply_prefix="")
    store = BatchStore(settings.batch_store)
    upload = file_doc(tenant, path.name, len(data), time.time())
    store.put_file(upload, data)
    try:
        doc = create_batch(
            store,
            settings,
            tenant=tenant,
            input_file_id=upload.id,
            endpoint=endpoint or _first_url(data),
            completion_window=window,
            metadata=metadata or None,
            check_body=BodyChecker(planner, caller),
            now=time.time(),
        )
    except BatchRefused as exc:
        raise click.ClickException(f"{exc.code}: {exc.message}") from None
    for error in (doc.errors.data if doc.errors else [])[:20]:
        click.echo(f"line {error.line}: {error.code}: {error.message}", err=True)
    if doc.is_terminal:
        raise click.ClickException(f"no line of {path} can run; batch {doc.id} failed")
    asyncio.run(_send(settings, "create", tenant, doc.id))
    click.echo(doc.id)
    if not no_wait:
        _follow(store, tenant, doc.id)


@batch.command()
@click.argument("batch_id")
@click.option("--tenant", default=None, help="The batch's tenant; default: found by id.")
def status(batch_id: str, tenant: str | None) -> None:
    """Print the batch's status document (OpenAI's batch object, with progress)."""
    doc = _doc(batch_id, tenant)
    click.echo(doc.model_dump_json(indent=2))


@batch.command()
@click.argument("batch_id")
@click.option("--tenant", default=None, help="The batch's tenant; default: found by id.")
@click.option("--errors", is_flag=True, help="The error file instead of the output file.")
def results(batch_id: str, tenant: str | None, errors: bool) -> None:
    """Write the batch's output file (or its error file) to stdout, one line per result."""
    from tokenbus.batch.store import BatchStore

    doc = _doc(batch_id, tenant)
    if not doc.is_terminal:
        raise click.ClickException(f"batch {batch_id} is {doc.status}; results come at its end")
    file_id = doc.error_file_id if errors else doc.output_file_id
    counts = doc.request_counts
    click.echo(f"{doc.status}: {counts.completed} results, {counts.failed} errors", err=True)
    if file_id is not None:
        sys.stdout.buffer.write(BatchStore(_settings().batch_store).file_bytes(doc.tenant, file_id))


@batch.command()
@click.argument("batch_id")
@click.option("--tenant", default=None, help="The batch's tenant; default: found by id.")
def cancel(batch_id: str, tenant: str | None) -> None:
    """Stop dispatching; running lines finish, the rest end as batch_cancelled."""
    doc = _doc(batch_id, tenant)
    if doc.is_terminal:
        raise click.ClickException(f"batch {batch_id} is {doc.status} already")
    asyncio.run(_send(_settings(), "cancel", doc.tenant, doc.id))
    click.echo(f"cancelling {batch_id}")


@batch.command("prune-topics")
@click.option(
    "--older-than",
    default="7d",
    show_default=True,
    help="Delete the reply topics of batches that ended at least this long ago (7d, 12h).",
)
@click.option("--tenant", default=None, help="Only this tenant's batches.")
@click.option("--dry-run", is_flag=True, help="Say what would go, delete nothing.")
def prune_topics(older_than: str, tenant: str | None, dry_run: bool) -> None:
    """Delete the reply topics of batches that ended (their files hold the results).

    Nothing else deletes them: a batch's topic is its results log while it runs, and
    after its end retention empties it but leaves the topic. A topic whose batch is not
    in the store, or has not ended that long ago, stays (tokenbus.batch.prune)."""
    import re

    from schemas import TENANT_ID_PATTERN
    from tokenbus.batch.prune import keep_reason
    from tokenbus.batch.store import BatchStore, NotFound
    from tokenbus.batch.submit import parse_window
    from tokenbus.kafka import delete_topics, topic_names
    from tokenbus.topics import Topics

    try:
        older_than_s = parse_window(older_than, min_s=1, max_s=float("inf"))
    except ValueError:
        raise click.BadParameter(
            f"{older_than!r} is not a duration such as '7d', '12h' or '30m'",
            param_hint="--older-than",
        ) from None
    if tenant is not None and re.fullmatch(TENANT_ID_PATTERN, tenant) is None:
        raise click.BadParameter(f"{tenant!r} is not a tenant id", param_hint="--tenant")
    settings = _settings()
    topics, store = Topics(settings.topic_prefix), BatchStore(settings.batch_store)
    now = time.time()
    doomed: list[str] = []
    for topic in sorted(asyncio.run(topic_names(settings))):
        ids = topics.batch_of(topic)
        if ids is None or tenant not in (None, ids[0]):
            continue
        try:
            doc: BatchDoc | None = store.batch(*ids)
        except NotFound:
            doc = None
        reason = keep_reason(doc, now, older_than_s)
        if reason is None:
            doomed.append(topic)
            click.echo(f"{'would delete' if dry_run else 'deleting'} {topic}")
        else:
            click.echo(f"keeping {topic}: {reason}")
    if dry_run:
        click.echo(f"{len(doomed)} reply topics of ended batches to delete")
        return
    failed = asyncio.run(delete_topics(settings, doomed)) if doomed else {}
    if failed:
        kept = ", ".join(f"{topic} (error {code})" for topic, code in sorted(failed.items()))
        raise click.ClickException(f"the broker did not delete {len(failed)} of them: {kept}")
    click.echo(f"{len(doomed)} reply topics of ended batches deleted")


def _doc(batch_id: str, tenant: str | None) -> BatchDoc:
    from tokenbus.batch.store import BatchStore, NotFound

    store = BatchStore(_settings().batch_store)
    try:
        return store.batch(tenant, batch_id) if tenant else store.find_batch(batch_id)
    except NotFound:
        raise click.ClickException(f"no batch {batch_id}") from None


def _first_url(data: bytes) -> str:
    import orjson

    for row in data.splitlines():
        if row.strip():
            try:
                url = orjson.loads(row).get("url")
            except (orjson.JSONDecodeError, AttributeError):
                break
            if isinstance(url, str):
                return url
            break
    raise click.ClickException("cannot tell the endpoint from the first line; pass --endpoint")


async def _send(
    settings: Settings, kind: Literal["create", "cancel"], tenant: str, batch_id: str
) -> None:
    from tokenbus.batch.commands import send_command
    from tokenbus.kafka import make_producer, wait_for_broker

    await wait_for_broker(settings, timeout_s=10)
    producer = make_producer(settings)
    await producer.start()
    try:
        await send_command(producer, settings, kind, tenant, batch_id)
    finally:
        await producer.stop()


def _follow(store: BatchStore, tenant: str, batch_id: str) -> None:
    """A progress bar over the status document, until the batch ends (Ctrl-C leaves it
    running: it needs no client)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
    )
    try:
        with Progress(*columns, transient=False) as progress:
            doc = store.batch(tenant, batch_id)
            task = progress.add_task(doc.status, total=doc.request_counts.total, detail="")
            while not doc.is_terminal:
                time.sleep(0.5)
                doc = store.batch(tenant, batch_id)
                counts = doc.request_counts
                eta = f", eta {doc.eta_s:.0f} s" if doc.eta_s is not None else ""
                detail = (
                    f"{counts.failed} failed, {doc.in_flight} in flight, "
                    f"{doc.usage.total_tokens} tokens{eta}"
                )
                progress.update(
                    task,
                    completed=counts.completed + counts.failed,
                    description=doc.status,
                    detail=detail,
                )
    except KeyboardInterrupt:
        click.echo(f"\nbatch {batch_id} runs on; `tokenbus batch status {batch_id}`", err=True)
        return
    click.echo(f"batch {batch_id} {doc.status}; `tokenbus batch results {batch_id} > out.jsonl`")
