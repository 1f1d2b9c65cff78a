"""The ``tokenbus`` command: run the local stack, ask it something, read the bill."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

import click
from pydantic import ValidationError

from tokenbus.config import Settings, settings_problem
from tokenbus_cli.batch import batch


def _settings(**overrides: object) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]


class _Commands(click.Group):
    """Bad settings (a TOKENBUS_* variable, an option that overrides one) end a command
    with one line a setting, not a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except ValidationError as exc:
            if exc.title != Settings.__name__:
                raise
            raise click.ClickException(settings_problem(exc)) from None


@click.group(cls=_Commands)
def main() -> None:
    """tokenbus: multi-tenant LLM serving on Kafka."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
"""How systemd, docker, a closed terminal and Ctrl-C stop a foreground service."""


@main.command()
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path, exists=True),
    help="A Hugging Face model directory. Default: build and serve a tiny model.",
)
@click.option("--workers", "num_workers", default=1, show_default=True, help="vLLM workers.")
def up(model_path: Path | None, num_workers: int) -> None:
    """Start the broker, the Faust job, vLLM workers and the billing sink; Ctrl-C,
    SIGTERM or SIGHUP stops them all, in order."""
    from rich.console import Console

    from tokenbus_cli.stack import (
        DEV_TENANT,
        Stack,
        StackError,
        StackLeftBehind,
        dev_api_key_path,
    )
    from tokenbus_cli.stack_state import stop_left_behind

    # Not wrapped at 80 columns where stderr is no terminal (a log, a service manager):
    # a message is one line there, whole, for whoever searches for it.
    console = Console(stderr=True, soft_wrap=True)
    settings = _settings(model_path=model_path)
    stack = Stack(settings, num_workers=num_workers)
    received: list[int] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()
        assert main_task is not None

        def on_signal(signum: int) -> None:
            if not received:
                received.append(signum)
                main_task.cancel()

        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, on_signal, signum)
        with console.status("starting tokenbus") as status:

            def progress(message: str) -> None:
                status.update(message)
                console.log(message)

            stack.on_progress = progress
            await stack.start()
        key_file = dev_api_key_path(stack.settings)
        dev = (
            f"Tenant {DEV_TENANT!r}, API key in {key_file} "
            f"(export TOKENBUS_API_KEY=$(cat {key_file})).\n"
            if key_file.exists() and settings.tenants_file is None
            else ""
        )
        console.print(
            f"[bold green]tokenbus is up[/] (Kafka at {settings.bootstrap}, "
            f"model {settings.served_model_name!r}, logs in {stack.logs}).\n{dev}"
            f'Try: tokenbus ask "Hello there" --tenant {DEV_TENANT}\n'
            "Ctrl-C (or SIGTERM, SIGHUP) stops everything; `tokenbus status` shows it."
        )
        while True:
            stack.check()
            await asyncio.sleep(1)

    def stop(code: int) -> None:
        # A second signal while stopping would only cut the ordered stop short.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        with contextlib.suppress(OSError):  # a closed terminal: nobody reads this
            console.print("stopping tokenbus ...")
        stack.stop()
        with contextlib.suppress(OSError):
            console.print("stopped.")
        sys.exit(code)

    try:
        asyncio.run(run())
    except (KeyboardInterrupt, asyncio.CancelledError):
        stop(0)
    except StackLeftBehind as exc:
        console.print(f"[bold yellow]{exc}[/]")
        if sys.stdin.isatty() and click.confirm("Stop them now?", default=False, err=True):
            stopped = stop_left_behind(settings.home)
            console.print(
                f"stopped {', '.join(s.name for s in stopped) or 'nothing'}; "
                "run `tokenbus up` again."
            )
        sys.exit(1)
    except StackError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        stop(1)
    stop(0)


@main.command()
def down() -> None:
    """Stop the local stack of this home: its `tokenbus up`, or what one left behind."""
    from tokenbus_cli.stack_state import StackState, stop_left_behind

    settings = Settings()
    state = StackState.load(settings.home)
    if state is None or not (state.owner_alive() or state.live_services()):
        StackState.clear(settings.home)
        click.echo(f"no tokenbus stack running from {settings.home}")
        return
    if state.owner_alive():
        click.echo(f"stopping tokenbus up (pid {state.owner_pid}) ...")
    stopped = stop_left_behind(settings.home)
    for service in stopped:
        click.echo(f"stopped {service.name} (pid {service.pid})")
    click.echo("stopped.")


@main.command()
@click.option(
    "--check",
    is_flag=True,
    help="Exit with status 1 if an existing topic's configs differ, or replication is short.",
)
def topics(check: bool) -> None:
    """Create tokenbus's topics on the configured Kafka cluster (those missing), with
    their configs; say which existing topics' configs differ from them."""
    from tokenbus.kafka import (
        broker_count,
        ensure_topics,
        topic_config_drift,
        topic_plan,
        wait_for_broker,
    )
    from tokenbus.topics import ConfigDrift, replication_advice
    from tokenbus_cli.stack import stack_topics

    settings = Settings()

    async def run() -> tuple[list[ConfigDrift], int]:
        await wait_for_broker(settings, timeout_s=120)
        await ensure_topics(settings, stack_topics(settings))
        return await topic_config_drift(settings), await broker_count(settings)

    drift, num_brokers = asyncio.run(run())
    advice = replication_advice(settings.replication_factor, num_brokers)
    configs = topic_plan(settings).named()
    for name, partitions in stack_topics(settings).items():
        planned = "".join(f", {k}={v}" for k, v in configs.get(name, {}).items())
        click.echo(
            f"{name}: {partitions} partitions, replication {settings.replication_factor}{planned}"
        )
    for item in drift:
        have = "unset" if item.have is None else repr(item.have)
        click.echo(
            f"warning: {item.topic} existed before with {item.name} {have}, not "
            f"{item.want!r}; set it with: kafka-configs.sh --bootstrap-server "
            f"{settings.bootstrap} --alter --entity-type topics --entity-name {item.topic} "
            f"--add-config {item.name}={item.want}",
            err=True,
        )
    if advice is not None:
        click.echo(f"warning: {advice}", err=True)
    if check and (drift or advice is not None):
        raise SystemExit(1)


@main.command()
def status() -> None:
    """Each service of the local stack: its pid, health and port."""
    from rich.console import Console
    from rich.table import Table

    from tokenbus_cli.stack_state import StackState
    from tokenbus_cli.status import service_health

    settings = Settings()
    state = StackState.load(settings.home)
    if state is None:
        click.echo(f"no tokenbus stack running from {settings.home}")
        sys.exit(3)
    health = asyncio.run(service_health(settings, state))
    owner = "running" if state.owner_alive() else "[red]gone: services left behind[/]"
    table = Table(title=f"tokenbus up (pid {state.owner_pid}): {owner}; Kafka {state.bootstrap}")
    for column in ("service", "pid", "health", "port"):
        table.add_column(column)
    for service in state.services:
        table.add_row(service.name, str(service.pid), health[service.name], str(service.port or ""))
    Console().print(table)
    sys.exit(0 if all(h.startswith("ok") for h in health.values()) else 1)


@main.command()
@click.argument("prompt")
@click.option("--tenant", required=True, help="The tenant the request is billed to.")
@click.option(
    "--priority",
    type=click.IntRange(0, 2),
    default=1,
    show_default=True,
    help="0 VIP, 1 standard, 2 batch.",
)
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--model", default=None, help="Model name; default: the served tiny model.")
@click.option("--session", "session_id", default=None, help="Continue a session (sess_...).")
@click.option(
    "--api-key",
    envvar="TOKENBUS_API_KEY",
    default=None,
    help="The tenant's API key or JWT [env TOKENBUS_API_KEY]; "
    "default: the development key `tokenbus up` wrote (<home>/dev-api-key).",
)
def ask(
    prompt: str,
    tenant: str,
    priority: int,
    max_tokens: int,
    model: str | None,
    session_id: str | None,
    api_key: str | None,
) -> None:
    """Send PROMPT through tokenbus and stream the answer to the terminal."""
    from aiokafka.errors import KafkaError
    from pydantic import ValidationError

    from producers import TokenbusClient, TokenbusTimeout
    from schemas import SamplingParams
    from tokenbus.kafka import wait_for_broker
    from tokenbus_cli.stack import bundled_broker_profile, dev_api_key_path

    settings = bundled_broker_profile(Settings())
    if api_key is None and dev_api_key_path(settings).exists():
        api_key = dev_api_key_path(settings).read_text().strip()
    if api_key is None:
        click.echo(
            "error: no credential: pass --api-key (or set TOKENBUS_API_KEY) with the "
            "tenant's API key or JWT",
            err=True,
        )
        sys.exit(2)

    async def run() -> int:
        try:
            await wait_for_broker(settings, timeout_s=5)
        except KafkaError:
            click.echo(
                f"error: no Kafka broker at {settings.bootstrap}; is `tokenbus up` running?",
                err=True,
            )
            return 2
        async with TokenbusClient(settings, tenant_id=tenant, credential=api_key) as client:
            request = await client.submit(
                prompt=prompt,
                model=model,
                priority=priority,
                sampling=SamplingParams(max_tokens=max_tokens),
                session_id=session_id,
            )
            num_tokens = 0
            async for chunk in client.stream(request):
                if chunk.error is not None:
                    retry = chunk.error.retry_after_s
                    hint = f" (retry after {retry:.1f} s)" if retry else ""
                    click.echo(
                        f"\nerror: {chunk.error.code}: {chunk.error.message}{hint}", err=True
                    )
                    return 1
                num_tokens += chunk.num_tokens
                click.echo(chunk.text, nl=False)
            click.echo()
            click.echo(
                f"[{num_tokens} tokens, {chunk.finish_reason}, request "
                f"{request.request_id}, session {request.session_id}]",
                err=True,
            )
            return 0

    try:
        sys.exit(asyncio.run(run()))
    except ValidationError as exc:
        click.echo(f"error: invalid request: {exc.errors()[0]['msg']}", err=True)
        sys.exit(2)
    except TokenbusTimeout as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@main.group()
def billing() -> None:
    """Usage and cost, from ClickHouse."""


@billing.command()
@click.option("--tenant", default=None, help="Only this tenant.")
def report(tenant: str | None) -> None:
    """Per-tenant and per-session token totals."""
    from rich.console import Console

    from billing.__main__ import billing_report

    billing_report(Settings(), Console(), tenant=tenant)


@billing.command("query")
@click.argument("name", required=False)
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="KEY=VALUE",
    help="A query parameter, e.g. --param tenant=acme --param since=2026-03-01.",
)
def billing_query(name: str | None, params: tuple[str, ...]) -> None:
    """Run dashboard query NAME (billing/dashboards/NAME.sql); without NAME, list them."""
    from rich.console import Console

    from billing.console import billing_query as run_query
    from billing.console import list_queries

    if name is None:
        list_queries(Console())
        return
    values: dict[str, str] = {}
    for pair in params:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--param")
        values[key.strip()] = value
    run_query(Settings(), Console(), name, values)


@main.group()
def budget() -> None:
    """Spend budgets: set, remove and show them while the stack runs."""


@budget.command("set")
@click.option("--tenant", help="The tenant's budget (with --model: tenant x model).")
@click.option("--model", help="A model's (or adapter's) budget; with --tenant, that pair's.")
@click.option("--key-sha256", help="An API key's budget, by the SHA-256 in the tenants file.")
@click.option("--limit", help="Cost units per period (the price table's unit); not with --delete.")
@click.option("--period", default="month", show_default=True, help="day|week|month|rolling:Nh")
@click.option("--tz", help="Zone of a calendar period; default TOKENBUS_BUDGET_TZ.")
@click.option("--soft", is_flag=True, help="Alert only; never refuse.")
@click.option("--thresholds", help="Alert at these % (default 50,80,95,100).")
@click.option(
    "--delete",
    is_flag=True,
    help="Remove the budget that --tenant/--model/--key-sha256, --period and --tz name.",
)
def budget_set(
    tenant: str | None,
    model: str | None,
    key_sha256: str | None,
    limit: str | None,
    period: str,
    tz: str | None,
    soft: bool,
    thresholds: str | None,
    delete: bool,
) -> None:
    """Write a budget to the budgets topic; every job instance applies it.

    A budget is its entity, its period and, for a calendar period, its zone: --delete
    removes the one that set with the same options wrote, and no other."""
    import re

    from pydantic import ValidationError

    from schemas import TENANT_ID_PATTERN
    from tokenbus.budget_admin import budget_record, publish_budget_change
    from tokenbus.budget_config import DEFAULT_THRESHOLDS, BudgetConfig

    if key_sha256 is not None and (tenant is not None or model is not None):
        raise click.UsageError("--key-sha256 names a key's budget by itself: drop --tenant/--model")
    if tenant is not None and re.fullmatch(TENANT_ID_PATTERN, tenant) is None:
        raise click.BadParameter(f"{tenant!r} is not a tenant id", param_hint="--tenant")
    if tz is not None and period.startswith("rolling:"):
        raise click.BadParameter("a rolling period has no zone", param_hint="--tz")
    if delete:
        # what set writes into a budget, beyond naming it
        values = (("--limit", limit), ("--soft", soft or None), ("--thresholds", thresholds))
        setting = [name for name, value in values if value is not None]
        if setting:
            raise click.UsageError(f"--delete removes a budget: {', '.join(setting)} would set one")
    elif limit is None:
        raise click.UsageError("Missing option '--limit' (needed unless --delete).")
    settings = Settings()
    try:
        config = BudgetConfig(
            tenant=tenant,
            model=model,
            key_sha256=key_sha256,
            limit=limit or "0",  # type: ignore[arg-type]
            period=period,
            tz=tz,
            enforce="soft" if soft else "hard",
            thresholds=DEFAULT_THRESHOLDS
            if thresholds is None
            else tuple(int(t) for t in thresholds.split(",") if t.strip()),
        )
        key, value = budget_record(config, settings.budget_tz)
    except (ValidationError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from None
    asyncio.run(publish_budget_change(settings, key, None if delete else value))
    if not delete:
        click.echo(f"set {key.decode()}")
        return
    zone = "" if period.startswith("rolling:") else f" in {tz or settings.budget_tz}"
    click.echo(
        f"removed {key.decode()}: the {period} budget{zone} of {config.entity}, as set with"
        " these options; its budgets of other periods or zones stay"
    )


@budget.command("show")
def budget_show() -> None:
    """Each budget's limit, spend, reservations and remainder this period (from the job)."""
    from rich.console import Console
    from rich.table import Table

    from tokenbus.budget_admin import job_budgets

    rows = job_budgets(Settings())["budgets"]
    table = Table("budget", "enforce", "period", "limit", "spent", "reserved", "remaining")
    for row in rows:
        table.add_row(
            *(
                str(row[c])
                for c in ("budget_id", "enforce", "period", "limit", "spent", "reserved")
            ),
            str(row["remaining"]),
        )
    Console().print(table)


@budget.command("reconcile")
@click.option(
    "--period",
    "periods",
    multiple=True,
    metavar="BUCKET",
    help="Only this bucket (2026-03-01 for a month or day, total for a token's balance); "
    "repeatable. Default: every bucket the job holds.",
)
@click.option("--settle-s", type=float, help="Wait before reading a drifting bucket again.")
def budget_reconcile(periods: tuple[str, ...], settle_s: float | None) -> None:
    """Compare the job's spend per budget and period with ClickHouse's billed_units;
    print any drift and exit 1 if there is some."""
    from billing.alerts.reconcile import reconcile
    from billing.reader import QueryError, open_reader
    from tokenbus.budget_admin import job_budgets

    settings = Settings()

    def buckets() -> list[dict[str, object]]:
        rows: list[dict[str, object]] = job_budgets(settings)["buckets"]
        return [r for r in rows if not periods or r["bucket"] in periods]

    try:
        reader = open_reader(settings)
    except QueryError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        wait = settings.budget_reconcile_settle_s if settle_s is None else settle_s
        num_buckets, drifts = reconcile(buckets, reader, settle_s=wait)
    finally:
        reader.close()
    for drift in drifts:
        click.echo(
            f"drift {drift.budget_id} {drift.bucket}: job {drift.job_units}, "
            f"ClickHouse {drift.billed_units} ({drift.drift_units:+})"
        )
    click.echo(f"{num_buckets} buckets compared, {len(drifts)} drifting")
    if drifts:
        raise SystemExit(1)


main.add_command(batch)


@main.command()
@click.argument("request_id")
@click.option("--tenant", required=True, help="The tenant the request belongs to.")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0),
    default=10.0,
    show_default=True,
    help="Seconds to wait for the request's spans to reach the store.",
)
def trace(request_id: str, tenant: str, wait_s: float) -> None:
    """Print REQUEST_ID's trace: every span of every service it went through, as a
    timeline, from tokenbus's own trace store (the spans topic, kept in ClickHouse by
    the billing process; with TOKENBUS_OTLP_ENDPOINT set, look in your collector)."""
    from billing.reader import QueryError, open_reader
    from billing.traces import TRACE_SQL, render, timeline

    settings = Settings()
    if settings.otlp_endpoint:
        click.echo(
            f"note: TOKENBUS_OTLP_ENDPOINT is set: spans go to {settings.otlp_endpoint}, "
            "not to tokenbus's store",
            err=True,
        )
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reader = open_reader(settings)
        except QueryError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            rows = reader.query(TRACE_SQL, {"tenant": tenant, "request_id": request_id})
        except QueryError as exc:
            raise click.ClickException(str(exc)) from None
        finally:
            reader.close()
        if rows or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if not rows:
        raise click.ClickException(
            f"no spans of request {request_id!r} for tenant {tenant!r} (spans arrive "
            "within a few seconds; tracing is off when TOKENBUS_TRACE_SAMPLE_RATIO=0)"
        )
    click.echo(render(timeline(rows)))


if __name__ == "__main__":
    main()
