"""`slurmgate reconcile` and `slurmgate status`: one admission tick, or the board it would show."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError

from slurmgate.cli.common import fail

if TYPE_CHECKING:
    from pydantic import SecretStr

    from slurmgate.github.app_auth import GitHubAppCredentials
    from slurmgate.github.scope import GitHubScope
    from slurmgate.settings.admission import AdmissionSettings

app = typer.Typer()

ApiUrl = Annotated[str, typer.Option(help="GitHub REST API base URL, or the emulator's URL.")]
Repo = Annotated[str | None, typer.Option(help="Repository scope, OWNER/NAME.")]
Org = Annotated[str | None, typer.Option(help="Organization scope, NAME.")]
Repos = Annotated[
    str | None,
    typer.Option(help="With --org: the repositories whose jobs are read, comma-separated."),
]
AllRepos = Annotated[
    bool,
    typer.Option(
        "--all-repos", help="With --org: read jobs of every repository the token or App sees."
    ),
]


def _token(purpose: str) -> SecretStr | GitHubAppCredentials:
    """$GITHUB_TOKEN, or the GitHub App the $SLURMGATE_GITHUB_APP_* variables name."""
    from slurmgate.github.app_auth import AppCredentialsError, credentials_from_env

    try:
        credentials = credentials_from_env()
    except AppCredentialsError as exc:
        raise fail(str(exc)) from None
    if credentials is None:
        raise fail(
            f"GITHUB_TOKEN is empty; export a token that can {purpose}, or authenticate as a "
            "GitHub App with SLURMGATE_GITHUB_APP_ID and SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE"
        )
    return credentials


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
    api_url: ApiUrl = "https://api.github.com",
    repo: Repo = None,
    org: Org = None,
    repos: Repos = None,
    all_repos: AllRepos = False,
) -> None:
    """One reconcile tick through the Prefect flow (token from GITHUB_TOKEN, flags from env)."""
    from slurmgate.cli import prefect_layer
    from slurmgate.github.scope import ScopeError
    from slurmgate.settings.admission import AdmissionSettings

    if not once:
        raise fail(
            "pass --once; for a tick every 30 s run the reconcile deployment "
            "(python -m slurmgate.deployments.serve, or slurmgate deploy and a worker)"
        )
    if (repo is None) == (org is None):
        raise fail("pass exactly one of --repo OWNER/NAME or --org NAME")
    token = _token("manage the runners (admin rights; any non-empty value for the emulator)")
    try:
        settings = AdmissionSettings()
    except ValidationError as exc:
        raise fail(f"bad admission settings in the environment: {exc}") from None
    # Before the flow: a wrong scope or token is then one line, not a failed flow run's
    # traceback after the ~20 s a temporary Prefect server takes to start.
    scope = _scope(api_url, repo, org, repos, all_repos)
    _check_access(scope, token)
    _say_what_the_flags_do(settings)
    try:
        summary = prefect_layer.run_reconcile_tick(scope)
    except ScopeError as exc:
        raise fail(str(exc)) from None
    except Exception as exc:
        typer.echo(f"error: tick failed: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(json.dumps(summary, sort_keys=True))


@app.command(
    "status",
    epilog=(
        "Example: GITHUB_TOKEN=... slurmgate status --api-url http://127.0.0.1:8787 "
        "--repo acme/gpu-ci"
    ),
)
def status(
    api_url: ApiUrl = "https://api.github.com",
    repo: Repo = None,
    org: Org = None,
    repos: Repos = None,
    all_repos: AllRepos = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the board rows as JSON.")] = False,
) -> None:
    """The pool and lease board of a live GitHub scope (reads only; token from GITHUB_TOKEN)."""
    from slurmgate.admission.tick import reconcile_tick
    from slurmgate.controller.steps import direct_steps
    from slurmgate.github.access import app_id_of, explain
    from slurmgate.github.app_auth import AppAuthError
    from slurmgate.github.client import GitHubClient
    from slurmgate.github.errors import GitHubError
    from slurmgate.settings.admission import AdmissionSettings

    token = _token("read the runners")
    scope = _scope(api_url, repo, org, repos, all_repos)
    try:
        settings = AdmissionSettings()
    except ValidationError as exc:
        raise fail(f"bad admission settings in the environment: {exc}") from None
    _check_access(scope, token)
    _say_what_the_flags_do(settings)

    async def read() -> list[dict[str, Any]]:
        async with GitHubClient(scope, token) as client:
            steps = direct_steps(client, read_only=True, settings=settings)
            report = await reconcile_tick(steps, settings, log=_Warnings())
        decisions = report.decisions
        rows = decisions.board_rows()
        for runner_id, reason in decisions.misconfigured_runners:
            rows.append({"pool": f"runner {runner_id}", "blocked": f"misconfigured: {reason}"})
        return rows

    try:
        rows = asyncio.run(read())
    except GitHubError as exc:
        raise fail(explain(scope, exc, app_id_of(token)), code=1) from None
    except AppAuthError as exc:
        raise fail(str(exc), code=1) from None
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    print_board(rows)


BOARD_COLUMNS = ("pool", "runners", "online", "leased", "busy_unleased", "free", "admitted_nodes")


class _Warnings:
    """The tick's warnings (a Slurm capacity read that failed, say) on stderr; info is quiet."""

    def info(self, msg: str, *args: Any) -> None:
        return None

    def warning(self, msg: str, *args: Any) -> None:
        typer.echo(f"warning: {msg % args if args else msg}", err=True)


def print_board(rows: list[dict[str, Any]]) -> None:
    """The board as a table when it fits the terminal unwrapped, else one block per pool:
    rich would otherwise fold a pool name or a reason mid-word (and a folded name reads as
    two pools)."""
    from rich import box
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    console = Console()
    table = Table(title="slurmgate pools", box=box.SIMPLE_HEAD, pad_edge=False)
    # pools mapped to Slurm partitions say what Slurm lacks; without any, the board is as before
    said = any(row.get("slurm") for row in rows)
    cordons = any(row.get("cordon") for row in rows)  # a cordoned pool says so, and how drained
    extra = [*(["slurm"] if said else []), *(["cordon"] if cordons else [])]
    for name in [*BOARD_COLUMNS, "blocked", *extra]:
        table.add_column(name.replace("_", " "), no_wrap=True)
    for row in rows:
        cells = [str(row.get(name, "")) for name in BOARD_COLUMNS]
        cells.append("\n".join(str(row.get("blocked", "")).split("; ")))
        cells += ["\n".join(str(row.get(name, "")).split("; ")) for name in extra]
        table.add_row(*cells)
    # measured unbounded: rich clamps a measurement to the width it is given
    unbounded = console.options.update_width(10_000)
    if Measurement.get(console, unbounded, table).maximum <= console.width:
        console.print(table)
        return

    def lines(words: list[str], separator: str) -> list[str]:
        """`words` joined by `separator` in lines of the console's width, never split."""
        out = ["  "]
        for word in words:
            joined = out[-1] + (separator if out[-1].strip() else "") + word
            if len(joined) <= console.width or not out[-1].strip():
                out[-1] = joined
            else:
                out.append("    " + word)
        return out

    for row in rows:
        typer.echo(f"pool {row.get('pool', '')}")
        fields = [f"{name.replace('_', ' ')} {row.get(name, '')}" for name in BOARD_COLUMNS[1:]]
        typer.echo("\n".join(lines(fields, ", ")))
        if row.get("blocked"):
            typer.echo("\n".join(lines(["blocked:", *str(row["blocked"]).split()], " ")))
        for name in ("slurm", "cordon"):
            if row.get(name):
                typer.echo("\n".join(lines([f"{name}:", *str(row[name]).split()], " ")))


def _say_what_the_flags_do(settings: AdmissionSettings) -> None:
    """The flags' warnings (the tick logs them too, in the flow run's log), and a note when the
    priority scheduler is off: the tick then admits nothing, which looks like a broken one."""
    for warning in settings.flag_warnings:
        typer.echo(f"warning: {warning}", err=True)
    if not settings.flag_warnings and not settings.PRIORITY_SCHEDULER_ENABLED:
        typer.echo(
            "note: PRIORITY_SCHEDULER_ENABLED is off, so nothing is admitted (finished jobs' "
            "leases are still released); export PRIORITY_SCHEDULER_ENABLED=true, and "
            "NODE_SLOT_SCHEDULER_ENABLED=true to size jobs by their nodes:N label",
            err=True,
        )


def _scope(
    api_url: str,
    repo: str | None,
    org: str | None,
    repos: str | None = None,
    all_repos: bool = False,
) -> GitHubScope:
    """The scope the options name; bad options are one line and exit 2."""
    from slurmgate.github.scope import GitHubScope

    job_repos = tuple(r.strip() for r in (repos or "").split(",") if r.strip())
    try:
        return GitHubScope(
            api_url=api_url, repo=repo, org=org, repos=job_repos, all_repos=all_repos
        )
    except ValidationError as exc:
        raise fail(
            "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        ) from None


def _check_access(scope: GitHubScope, token: SecretStr | GitHubAppCredentials) -> None:
    """One read of the scope's runners; a refusal is one line naming the fix, exit 1."""
    from slurmgate.github.access import ScopeAccessError, check_access

    try:
        asyncio.run(check_access(scope, token))
    except ScopeAccessError as exc:
        raise fail(str(exc), code=1) from None
