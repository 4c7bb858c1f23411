"""`slurmgate emulator`: the GitHub API emulator, the local stand-in for GitHub, as commands."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from slurmgate.cli.common import fail
from slurmgate.testbed.emulator.admin import (
    DEFAULT_PORT,
    DEFAULT_URL,
    EmulatorAdmin,
    EmulatorAdminError,
)
from slurmgate.testbed.emulator.state import EmulatorInputError, fleet_from_job_mix, parse_pool

app = typer.Typer()
emulator_app = typer.Typer(
    help=(
        "Serve a GitHub API emulator holding a runner fleet (a real HTTP server), or drive a "
        "running one: queue and complete jobs, take runners offline and back."
    ),
    epilog=(
        "Example: slurmgate emulator --port 8787 --repo acme/gpu-ci "
        "--pool cluster:h100=8 --pool cluster:b200=18 --legacy 2"
    ),
)
app.add_typer(emulator_app, name="emulator")

EmulatorUrl = Annotated[
    str, typer.Option("--url", help="Base URL of the running emulator.", show_default=True)
]


@emulator_app.callback(invoke_without_command=True)
def emulator(
    ctx: typer.Context,
    port: Annotated[
        int, typer.Option(help="TCP port to listen on (0 picks a free one).")
    ] = DEFAULT_PORT,
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
    fault_rate: Annotated[
        float,
        typer.Option(help="Share of GitHub requests answered with a random fault (0..1)."),
    ] = 0.0,
    fault_seed: Annotated[int, typer.Option(help="Seed of the random faults.")] = 0,
) -> None:
    """Serve a GitHub API emulator holding a runner fleet (a real HTTP server).

    Without a command it serves until Ctrl-C; the commands below drive a running one.
    """
    from slurmgate.testbed.emulator.server import run_emulator

    if ctx.invoked_subcommand is not None:
        return
    if not 0 <= port <= 65535:
        raise fail(f"--port {port} is not a TCP port; use 0..65535")
    if legacy < 0:
        raise fail(f"--legacy {legacy} is negative; use 0 or more")
    if quota < 0:
        raise fail(f"--quota {quota} is negative; use 0 or more")
    for url in webhook_url or []:
        if not url.startswith(("http://", "https://")):
            raise fail(f"--webhook-url {url!r} is not an http(s) URL")
    if token is not None and not token.strip():
        raise fail("--token is empty; give a token or leave the option out")
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
        from slurmgate.testbed.emulator.state import FaultPlan, build_state

        faults = FaultPlan(rate=fault_rate, seed=fault_seed)
        build_state(repo, pools, legacy, token)  # validate everything before binding the port
    except (EmulatorInputError, OSError) as exc:
        raise fail(str(exc)) from None
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
            fault_plan=faults,
            announce=announce,
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise fail(f"cannot listen on {host}:{port} ({reason}); pick another --port") from None


# `slurmgate emulator … &` followed at once by `slurmgate emulator queue …` is how people use it;
# the server needs a few seconds to import and bind on a busy 2-core machine.
EMULATOR_START_WAIT_S = 10.0


@contextmanager
def _admin(url: str) -> Iterator[EmulatorAdmin]:
    """An admin client of the emulator at `url`; its refusals are one line (unknown id: exit 2,
    anything else, such as no emulator listening: exit 1)."""
    if not url.startswith(("http://", "https://")):
        raise fail(f"--url {url!r} is not an http(s) URL; e.g. {DEFAULT_URL}")
    try:
        with EmulatorAdmin(url, start_wait_s=EMULATOR_START_WAIT_S) as admin:
            yield admin
    except EmulatorAdminError as exc:
        raise fail(str(exc), code=2 if exc.status in (400, 404) else 1) from None


def _labels(raw: str) -> list[str]:
    labels = [label.strip() for label in raw.split(",") if label.strip()]
    if not labels:
        raise fail("--labels is empty; give the job's runs-on, e.g. self-hosted,cluster:h100")
    return labels


@emulator_app.command(
    "queue",
    epilog=(
        "Example: slurmgate emulator queue --labels self-hosted,cluster:h100,nodes:10 "
        "--duration 600"
    ),
)
def queue(
    labels: Annotated[
        str, typer.Option(help="The job's runs-on labels, comma-separated.", show_default=False)
    ],
    duration: Annotated[
        float, typer.Option(help="Seconds the job runs once GitHub dispatches it.")
    ] = 600.0,
    name: Annotated[str | None, typer.Option(help="The job's name.")] = None,
    url: EmulatorUrl = DEFAULT_URL,
) -> None:
    """Queue a workflow job with these runs-on labels; prints its job id."""
    if duration < 0:
        raise fail(f"--duration {duration:g} is negative; give the seconds the job runs")
    with _admin(url) as admin:
        job = admin.add_job(_labels(labels), duration, name=name)
    typer.echo(job["id"])


@emulator_app.command(
    "complete", epilog="Example: slurmgate emulator complete 50001 --conclusion failure"
)
def complete(
    job_id: Annotated[int, typer.Argument(help="The job id `queue` printed.")],
    conclusion: Annotated[
        str, typer.Option(help="success, failure, cancelled, ... (GitHub's conclusions).")
    ] = "success",
    url: EmulatorUrl = DEFAULT_URL,
) -> None:
    """Finish a job now, as if its workflow ended, freeing its runner."""
    with _admin(url) as admin:
        if not any(job["id"] == job_id for job in admin.dump()["jobs"]):
            raise fail(
                f"no job {job_id} on the emulator at {url}; `slurmgate emulator jobs` lists them"
            )
        job = admin.complete_job(job_id, conclusion)
    typer.echo(f"job {job['id']} {job['status']} ({job['conclusion']})")


def _set_status(runner: str, url: str, status: str) -> None:
    with _admin(url) as admin:
        found = admin.set_runner_status(admin.runner_id(runner), status)
    typer.echo(f"runner {found['id']} ({found['name']}) {found['status']}")


RunnerArg = Annotated[str, typer.Argument(help="A runner id, or its name (e.g. h100-03).")]


@emulator_app.command("offline", epilog="Example: slurmgate emulator offline h100-03")
def offline(runner: RunnerArg, url: EmulatorUrl = DEFAULT_URL) -> None:
    """Take a runner offline, as if its machine went away (it then counts as no capacity)."""
    _set_status(runner, url, "offline")


@emulator_app.command("online", epilog="Example: slurmgate emulator online h100-03")
def online(runner: RunnerArg, url: EmulatorUrl = DEFAULT_URL) -> None:
    """Bring a runner back online."""
    _set_status(runner, url, "online")


@emulator_app.command("jobs", epilog="Example: slurmgate emulator jobs")
def jobs(url: EmulatorUrl = DEFAULT_URL) -> None:
    """List the emulator's jobs: id, status, the runner GitHub dispatched it to, labels."""
    with _admin(url) as admin:
        listed: list[dict[str, Any]] = admin.dump()["jobs"]
    for job in listed:
        where = job.get("runner_name") or "-"
        typer.echo(f"{job['id']}  {job['status']:<11}  {where:<12}  {','.join(job['labels'])}")


@emulator_app.command(
    "app",
    epilog=(
        'Example: eval "$(slurmgate emulator app --key-file app.pem)"; '
        "slurmgate status --api-url http://127.0.0.1:8787 --repo acme/gpu-ci"
    ),
)
def github_app(
    key_file: Annotated[
        Path,
        typer.Option(
            help="Where to write the App's private key (created 0600).", show_default=False
        ),
    ],
    permission: Annotated[
        list[str] | None,
        typer.Option(
            help=(
                "A permission the installation grants, NAME=LEVEL (read, write or admin); "
                "repeat it. Default: all the controller needs. Fewer show GitHub's refusal."
            ),
            show_default=False,
        ),
    ] = None,
    url: EmulatorUrl = DEFAULT_URL,
) -> None:
    """Register a GitHub App installed on the emulator's owner, write its private key, and print
    the variables that make the commands authenticate as it."""
    target = key_file.expanduser()
    if target.exists():
        raise fail(
            f"--key-file {str(target)!r} exists; give a new path (a key is never overwritten)"
        )
    granted: dict[str, str] | None = None
    if permission:
        granted = {}
        for given in permission:
            name, sep, level = given.partition("=")
            if not sep or not name.strip() or not level.strip():
                raise fail(f"--permission {given!r} is not NAME=LEVEL; e.g. actions=read")
            granted[name.strip()] = level.strip()
    with _admin(url) as admin:
        created = admin.create_app(permissions=granted)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(created["private_key"])
    except OSError as exc:
        raise fail(
            f"--key-file {str(target)!r} cannot be written ({exc.strerror or exc})"
        ) from None
    typer.echo(f"export SLURMGATE_GITHUB_APP_ID={created['app_id']}")
    typer.echo(f"export SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE={target.resolve()}")
    typer.echo(f"# installation {created['installation_id']} on {created['account']} (looked up)")
