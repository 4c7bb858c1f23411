"""`slurmgate init`: save the GitHub scope and admission policy blocks the deployments load.

The packaged deployments (`slurmgate deploy`) name a `slurmgate-github-scope` and a
`slurmgate-admission-policy` block called `default`; a worker without them fails its first run.
This command saves both on the Prefect API the user configured, from a few flags, with the token
from GITHUB_TOKEN or a hidden prompt (never from argv, where `ps` and shell history see it), or
with a GitHub App's credentials: its id, and its private key read from a file (--app-private-key-
file) or from $SLURMGATE_GITHUB_APP_PRIVATE_KEY(_FILE), never from the command line.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import typer
from pydantic import ValidationError

from slurmgate.cli.common import fail
from slurmgate.settings.admission import AdmissionSettings, PolicyName
from slurmgate.settings.github import GitHubSettings

if TYPE_CHECKING:
    from slurmgate.github.app_auth import GitHubAppCredentials

app = typer.Typer()


def _from_settings(name: str) -> tuple[Any, str]:
    """A policy knob's default and its help, as AdmissionSettings defines them (the one place
    a knob is written down: the block and the environment read the same model)."""
    field = AdmissionSettings.model_fields[name]
    first = (field.description or "").split(" (env")[0].split(". ")[0]
    return field.default, first.rstrip(".") + "."


POLICY_DEFAULT, POLICY_HELP = _from_settings("policy")
TIMEOUT_DEFAULT, TIMEOUT_HELP = _from_settings("timeout_min")
_, PRIORITY_HELP = _from_settings("PRIORITY_SCHEDULER_ENABLED")
_, NODE_SLOTS_HELP = _from_settings("NODE_SLOT_SCHEDULER_ENABLED")

NEXT_STEP = (
    "next: prefect work-pool create slurmgate --type process; "
    "slurmgate deploy; "
    "prefect worker start --pool slurmgate"
)


def _one_line(exc: ValidationError) -> str:
    return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())


def _token() -> str:
    token = (GitHubSettings.text("token") or "").strip()
    if token:
        return token
    if not sys.stdin.isatty():
        raise fail(
            "GITHUB_TOKEN is empty and there is no terminal to ask on; export GITHUB_TOKEN "
            "(a token with admin rights on the runners)"
        )
    token = str(typer.prompt("GitHub token (input hidden)", hide_input=True)).strip()
    if not token:
        raise fail("the token is empty; give a GitHub token with admin rights on the runners")
    return token


def _app_credentials(
    app_id: int | None, installation_id: int | None, key_file: Path | None
) -> GitHubAppCredentials | None:
    """The App the flags name, over the $SLURMGATE_GITHUB_APP_* variables; None for neither."""
    from slurmgate.github.app_auth import (
        APP_ID_ENV,
        APP_INSTALLATION_ID_ENV,
        APP_PRIVATE_KEY_ENV,
        APP_PRIVATE_KEY_FILE_ENV,
        AppCredentialsError,
        app_credentials_from_env,
    )

    env = GitHubSettings.environ()
    if app_id is not None:
        env[APP_ID_ENV] = str(app_id)
    if installation_id is not None:
        env[APP_INSTALLATION_ID_ENV] = str(installation_id)
    if key_file is not None:
        env[APP_PRIVATE_KEY_FILE_ENV] = str(key_file)
        env.pop(APP_PRIVATE_KEY_ENV, None)
    try:
        credentials = app_credentials_from_env(env)
    except AppCredentialsError as exc:
        message = str(exc).replace(f"${APP_ID_ENV}", f"--app-id (${APP_ID_ENV})")
        message = message.replace(
            f"${APP_PRIVATE_KEY_FILE_ENV}", f"--app-private-key-file (${APP_PRIVATE_KEY_FILE_ENV})"
        )
        raise fail(message) from None
    return credentials


def _check_prefect_api(url: str, auth_string: str | None) -> None:
    """One GET of the API's /health, so an unreachable server is one line, not a client's
    retries ending in a traceback. (/health answers without credentials: wrong ones show
    when the blocks are saved.)"""
    user, _, password = (auth_string or "").partition(":")
    try:
        response = httpx.get(
            url.rstrip("/") + "/health",
            auth=(user, password) if auth_string else None,
            timeout=10.0,
        )
    except httpx.HTTPError as exc:
        raise fail(
            f"the Prefect API at {url} does not answer ({type(exc).__name__}); start it "
            "(prefect server start) or point PREFECT_API_URL at a running server",
            code=1,
        ) from None
    if response.status_code != 200:
        raise fail(
            f"the Prefect API at {url} answered {response.status_code} to /health; is "
            "PREFECT_API_URL the API's URL (ending in /api)?",
            code=1,
        )


@app.command(
    "init",
    epilog=(
        "Example: GITHUB_TOKEN=... PREFECT_API_URL=http://127.0.0.1:4200/api slurmgate init "
        "--repo acme/gpu-ci --priority-scheduler --node-slot-scheduler"
    ),
)
def init(
    repo: Annotated[str | None, typer.Option(help="Runners of one repository, OWNER/NAME.")] = None,
    org: Annotated[str | None, typer.Option(help="Runners of an organization, NAME.")] = None,
    repos: Annotated[
        str | None,
        typer.Option(help="With --org: the repositories whose jobs are read, comma-separated."),
    ] = None,
    all_repos: Annotated[
        bool,
        typer.Option(
            "--all-repos", help="With --org: read jobs of every repository the token or App sees."
        ),
    ] = False,
    api_url: Annotated[
        str, typer.Option(help="GitHub REST API base URL, or the emulator's URL.")
    ] = "https://api.github.com",
    priority_scheduler: Annotated[
        bool,
        typer.Option(
            "--priority-scheduler/--no-priority-scheduler",
            help=f"PRIORITY_SCHEDULER_ENABLED: {PRIORITY_HELP}",
        ),
    ] = False,
    node_slot_scheduler: Annotated[
        bool,
        typer.Option(
            "--node-slot-scheduler/--no-node-slot-scheduler",
            help=f"NODE_SLOT_SCHEDULER_ENABLED: {NODE_SLOTS_HELP}",
        ),
    ] = False,
    policy: Annotated[PolicyName, typer.Option(help=POLICY_HELP)] = POLICY_DEFAULT,
    timeout_min: Annotated[
        float | None,
        typer.Option(help=f"{TIMEOUT_HELP} Default {TIMEOUT_DEFAULT:g}.", show_default=False),
    ] = None,
    name: Annotated[
        str, typer.Option(help="Block name; the deployments load `default`.")
    ] = "default",
    check: Annotated[
        bool,
        typer.Option(help="Read the scope's runners once with the token before saving."),
    ] = True,
    app_id: Annotated[
        int | None,
        typer.Option(
            help="Authenticate as this GitHub App instead of a token (or SLURMGATE_GITHUB_APP_ID).",
            show_default=False,
        ),
    ] = None,
    app_private_key_file: Annotated[
        Path | None,
        typer.Option(
            help="The App's .pem private key file (or SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE).",
            show_default=False,
        ),
    ] = None,
    app_installation_id: Annotated[
        int | None,
        typer.Option(
            help="The App's installation id; looked up from the repo or org when not given.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Save the GitHub scope (with its token or GitHub App) and the admission policy as blocks."""
    from slurmgate.cli import prefect_layer
    from slurmgate.github.access import ScopeAccessError, check_access
    from slurmgate.github.scope import GitHubScope

    job_repos = tuple(r.strip() for r in (repos or "").split(",") if r.strip())
    try:
        scope = GitHubScope(
            api_url=api_url, repo=repo, org=org, repos=job_repos, all_repos=all_repos
        )
    except ValidationError as exc:
        raise fail(_one_line(exc)) from None
    if node_slot_scheduler and not priority_scheduler:
        raise fail(
            "--node-slot-scheduler needs --priority-scheduler (NODE_SLOT_SCHEDULER_ENABLED=true "
            "requires PRIORITY_SCHEDULER_ENABLED=true); add --priority-scheduler"
        )
    knobs: dict[str, Any] = {"policy": policy}
    if timeout_min is not None:
        knobs["timeout_min"] = timeout_min
    try:  # the settings are the one definition of a valid knob; the block mirrors them
        AdmissionSettings(**knobs)
    except ValidationError as exc:
        raise fail(_one_line(exc)) from None
    policy_fields: dict[str, Any] = {
        "priority_scheduler_enabled": priority_scheduler,
        "node_slot_scheduler_enabled": node_slot_scheduler,
        **knobs,
    }

    prefect_api = prefect_layer.configured_prefect_api()
    if prefect_api is None:
        raise fail(
            "PREFECT_API_URL is not set, so the blocks would go to a temporary Prefect server "
            "and vanish when this command exits; start a server (prefect server start) and "
            "run `prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`, then run "
            "slurmgate init again",
            code=1,
        )
    api, auth_string = prefect_api
    app_credentials = _app_credentials(app_id, app_installation_id, app_private_key_file)
    credentials = app_credentials if app_credentials is not None else _token()
    if check:
        try:
            asyncio.run(check_access(scope, credentials))
        except ScopeAccessError as exc:
            raise fail(f"{exc} (or pass --no-check to save anyway)", code=1) from None
    _check_prefect_api(api, auth_string)
    auth: dict[str, Any] = (
        {
            "app_id": app_credentials.app_id,
            "app_private_key": app_credentials.private_key,
            "app_installation_id": app_credentials.installation_id,
        }
        if app_credentials is not None
        else {"token": credentials}
    )
    scope_fields: dict[str, Any] = {
        "api_url": scope.api_url,
        "repo": scope.repo,
        "org": scope.org,
        "repos": list(scope.repos),
        "all_repos": scope.all_repos,
        **auth,
    }
    try:
        prefect_layer.save_slurmgate_blocks(name, scope_fields, policy_fields)
    except Exception as exc:  # the Prefect client's failures have no common base class
        raise fail(
            f"saving the blocks on the Prefect API at {api} failed: {type(exc).__name__}: "
            f"{exc} (a server with basic auth needs PREFECT_API_AUTH_STRING=user:password)",
            code=1,
        ) from None
    where = f"repo {scope.repo}" if scope.repo else f"org {scope.org}"
    if app_credentials is not None:
        where += f", as GitHub App {app_credentials.app_id}"
    flags = (
        f"priority scheduler {'on' if priority_scheduler else 'off'}, "
        f"node slots {'on' if node_slot_scheduler else 'off'}, policy {policy}"
    )
    typer.echo(
        f"saved slurmgate-github-scope/{name} ({where} on {scope.api_url}) and "
        f"slurmgate-admission-policy/{name} ({flags}) on the Prefect API at {api}"
    )
    typer.echo(NEXT_STEP)
