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
