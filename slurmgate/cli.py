"""The `slurmgate` command line (typer): one sub-command per user-facing job."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import click
import typer

from slurmgate.emulator.state import EmulatorInputError, fleet_from_job_mix, parse_pool

app = typer.Typer(
    name="slurmgate",
    help="Admit multi-node GPU jobs from GitHub Actions onto Slurm, and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """slurmgate: weighted runner leases for GitHub Actions on Slurm, run by Prefect."""


def _fail(message: str) -> typer.Exit:
    """A one-line error on stderr and exit code 2 (bad arguments), never a traceback."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


@app.command(
    "emulator",
    epilog=(
        "Example: slurmgate emulator --port 8787 --repo acme/gpu-ci "
        "--pool cluster:h100=8 --pool cluster:b200=18 --legacy 2"
    ),
)
def emulator(
    port: Annotated[int, typer.Option(help="TCP port to listen on (0 picks a free one).")] = 8787,
    repo: Annotated[
        str, typer.Option(help="The repository it serves, OWNER/NAME.")
    ] = "acme/gpu-ci",
    pool: Annotated[
        list[str] | None,
        typer.Option(help="A runner pool, cluster:NAME=COUNT; repeat for more pools."),
    ] = None,
    legacy: Annotated[int, typer.Option(help="Runners without a cluster: label.")] = 0,
    token: Annotated[
        str | None,
        typer.Option(help="Accept only this bearer token (default: any non-empty token)."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    job_mix: Annotated[
        Path | None,
        typer.Option(help="Add pools shaped like a job-mix CSV (cluster_pool, runner counts)."),
    ] = None,
    quota: Annotated[int, typer.Option(help="Primary rate-limit quota per window.")] = 5000,
    webhook_url: Annotated[
        list[str] | None,
        typer.Option(help="POST signed workflow_job webhooks here on every job change."),
    ] = None,
    webhook_secret: Annotated[
        str | None,
        typer.Option(
            help="Secret for X-Hub-Signature-256.",
            envvar="SLURMGATE_WEBHOOK_SECRET",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve a GitHub API emulator holding a runner fleet (a real HTTP server)."""
    from slurmgate.emulator.server import run_emulator

    if not 0 <= port <= 65535:
        raise _fail(f"--port {port} is not a TCP port; use 0..65535")
    if legacy < 0:
        raise _fail(f"--legacy {legacy} is negative; use 0 or more")
    if quota < 0:
        raise _fail(f"--quota {quota} is negative; use 0 or more")
    for url in webhook_url or []:
        if not url.startswith(("http://", "https://")):
            raise _fail(f"--webhook-url {url!r} is not an http(s) URL")
    if token is not None and not token.strip():
        raise _fail("--token is empty; give a token or leave the option out")
    try:
        pools: dict[str, int] = {}
        if job_mix is not None:
            pools.update(fleet_from_job_mix(job_mix))
        for spec in pool or []:
            name, count = parse_pool(spec)
            pools[name] = count
        if not pools and not legacy:
            raise EmulatorInputError(
                "the fleet is empty; add --pool cluster:NAME=COUNT, --legacy COUNT or --job-mix CSV"
            )
        from slurmgate.emulator.state import build_state

        build_state(repo, pools, legacy, token)  # validate everything before binding the port
    except (EmulatorInputError, OSError) as exc:
        raise _fail(str(exc)) from None
    fleet = ", ".join(f"cluster:{n}={c}" for n, c in pools.items())
    if legacy:
        fleet += f"{', ' if fleet else ''}legacy={legacy}"

    def announce(url: str) -> None:
        typer.echo(f"GitHub emulator for {repo} on {url} ({fleet}); Ctrl-C stops it", err=True)

    try:
        run_emulator(
            port,
            repo,
            pools,
            legacy,
            token,
            host=host,
            quota_limit=quota,
            webhook_urls=list(webhook_url or []),
            webhook_secret=webhook_secret,
            announce=announce,
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise _fail(f"cannot listen on {host}:{port} ({reason}); pick another --port") from None


@app.command(
    "reconcile",
    epilog=(
        "Example: GITHUB_TOKEN=... PRIORITY_SCHEDULER_ENABLED=true slurmgate reconcile --once "
        "--api-url http://127.0.0.1:8787 --repo acme/gpu-ci"
    ),
)
def reconcile(
    once: Annotated[
        bool, typer.Option("--once", help="Run one tick and exit (the only mode here).")
    ] = False,
    api_url: Annotated[
        str, typer.Option(help="GitHub REST API base URL, or the emulator's URL.")
    ] = "https://api.github.com",
    repo: Annotated[str | None, typer.Option(help="Repository scope, OWNER/NAME.")] = None,
    org: Annotated[str | None, typer.Option(help="Organization scope, NAME.")] = None,
) -> None:
    """One reconcile tick through the Prefect flow (token from GITHUB_TOKEN, flags from env)."""
    if not once:
        raise _fail(
            "pass --once; for a tick every 30 s run the reconcile deployment "
            "(python deployments/serve.py, or prefect deploy with deployments/prefect.yaml)"
        )
    from flows.reconcile import reconcile_once_cli

    code = reconcile_once_cli(api_url, repo=repo, org=org)
    if code:
        raise typer.Exit(code=code)


@app.command(
    "status",
    epilog=(
        "Example: GITHUB_TOKEN=... slurmgate status --api-url http://127.0.0.1:8787 "
        "--repo acme/gpu-ci"
    ),
)
def status(
    api_url: Annotated[
        str, typer.Option(help="GitHub REST API base URL, or the emulator's URL.")
    ] = "https://api.github.com",
    repo: Annotated[str | None, typer.Option(help="Repository scope, OWNER/NAME.")] = None,
    org: Annotated[str | None, typer.Option(help="Organization scope, NAME.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the board rows as JSON.")] = False,
) -> None:
    """The pool and lease board of a live GitHub scope (reads only; token from GITHUB_TOKEN)."""
    import asyncio
    import json
    import os
    from datetime import UTC, datetime

    from pydantic import ValidationError
    from rich.console import Console
    from rich.table import Table

    from slurmgate.github import GitHubClient, GitHubError, GitHubScope
    from slurmgate.planner import plan
    from slurmgate.settings import AdmissionSettings
    from slurmgate.snapshot import take_snapshot

    token = os.environ.get("GITHUB_TOKEN", "").strip()
    if not token:
        raise _fail("GITHUB_TOKEN is empty; export a token that can read the runners")
    try:
        scope = GitHubScope(api_url=api_url, repo=repo, org=org)
        settings = AdmissionSettings()
    except (ValidationError, ValueError) as exc:
        raise _fail(" ".join(str(exc).split())) from None

    async def read() -> list[dict[str, object]]:
        async with GitHubClient(scope, token) as client:
            snapshot = await take_snapshot(client)
        decisions = plan(snapshot, settings, datetime.now(UTC))
        rows = decisions.board_rows()
        for runner_id, reason in decisions.misconfigured_runners:
            rows.append({"pool": f"runner {runner_id}", "blocked": f"misconfigured: {reason}"})
        return rows

    try:
        rows = asyncio.run(read())
    except GitHubError as exc:
        typer.echo(f"error: reading {scope.api_url} failed: {exc}", err=True)
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="slurmgate pools")
    columns = ["pool", "runners", "online", "leased", "busy_unleased", "free", "admitted_nodes"]
    for name in [*columns, "blocked"]:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(str(row.get(name, "")) for name in [*columns, "blocked"]))
    Console().print(table)


@app.command(
    "loadgen",
    epilog=(
        "Example: slurmgate loadgen http://127.0.0.1:17000 --concurrency 32 --duration 10 --json"
    ),
)
def loadgen(
    url: Annotated[str, typer.Argument(help="Base URL of an endpoint, e.g. http://HOST:PORT.")],
    path: Annotated[str, typer.Option(help="Request path.")] = "/v1/completions",
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 8,
    duration: Annotated[float | None, typer.Option(help="Seconds to run (default 10).")] = None,
    requests: Annotated[int | None, typer.Option(help="Stop after this many requests.")] = None,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of each completion.")] = 16,
    model: Annotated[str, typer.Option(help="Model name sent in each request.")] = "stub-model",
    stream: Annotated[bool, typer.Option(help="Ask for SSE streaming.")] = False,
    honour_retry_after: Annotated[
        bool, typer.Option(help="Wait a 429's Retry-After before the next request.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Drive an endpoint at a set concurrency; report throughput, latency percentiles and 429s."""
    import asyncio
    import json

    from slurmgate.loadgen import LoadSpec, run_load

    if not url.startswith(("http://", "https://")):
        raise _fail(f"URL {url!r} is not an http(s) URL; e.g. http://127.0.0.1:17000")
    spec = LoadSpec(
        url=url,
        path=path,
        concurrency=concurrency,
        duration=duration if duration is not None or requests is not None else 10.0,
        requests=requests,
        body={"model": model, "prompt": "hello", "max_tokens": max_tokens}
        | ({"stream": True} if stream else {}),
        honour_retry_after=honour_retry_after,
    )
    try:
        spec.check()
    except ValueError as exc:
        raise _fail(f"{exc}") from None
    report = asyncio.run(run_load(spec))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo(
            f"{report.ok} ok, {report.throttled} throttled (429), "
            f"errors {report.errors or 'none'} in {report.elapsed:.2f}s: "
            f"{report.throughput:.0f} req/s, p50 {report.latency_p50 * 1e3:.2f} ms, "
            f"p99 {report.latency_p99 * 1e3:.2f} ms"
        )
    if not report.ok:
        raise typer.Exit(code=1)


def _register_subcommands() -> None:
    """Sub-apps that live beside the modules they drive; importing them is cheap (typer only)."""
    from slurmgate.runtime.cli import allocation_app, cluster_app

    app.add_typer(cluster_app, name="cluster")
    app.add_typer(allocation_app, name="allocation")

    from slurmgate import ci_cli, webhook_cli
    from slurmgate.simulator.cli import simulate_command

    ci_cli.register(app)
    webhook_cli.register(app)

    app.command(
        "simulate",
        epilog=(
            "Example: slurmgate simulate slurmgate/data/traces/KTH-SP2-1996-2.1-cln.swf.gz "
            "--pools 100 --policy easy --json"
        ),
    )(simulate_command)


_register_subcommands()


def _exceptions(name: str) -> tuple[type[BaseException], ...]:
    """click's exception class `name`, and typer's vendored copy of it when typer has one."""
    found: list[type[BaseException]] = [getattr(click.exceptions, name)]
    with contextlib.suppress(ImportError, AttributeError):
        import typer._click.exceptions as vendored

        found.append(getattr(vendored, name))
    if name in ("Exit", "Abort"):
        found.append(getattr(typer, name))
    return tuple(found)


_USAGE = _exceptions("UsageError")
_EXIT = _exceptions("Exit")
_ABORT = _exceptions("Abort")


def main(argv: list[str] | None = None) -> None:
    """The console-script entry point: usage errors are one line on stderr and exit code 2."""
    try:
        code = app(args=argv, standalone_mode=False)
    except _USAGE as exc:
        formatter = getattr(exc, "format_message", None)
        message = formatter() if callable(formatter) else str(exc)
        if type(exc).__name__ == "NoArgsIsHelpError":
            typer.echo(message, err=True)
        else:
            typer.echo(f"error: {' '.join(str(message).split())}", err=True)
        raise SystemExit(2) from None
    except _ABORT:
        raise SystemExit(130) from None
    except _EXIT as exc:
        raise SystemExit(getattr(exc, "exit_code", 0)) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
