"""`slurmgate webhook`: serve the relay that turns GitHub webhooks into Prefect events."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from slurmgate.cli.common import fail
from slurmgate.settings.github import GitHubSettings
from slurmgate.settings.prefect import PrefectSettings

SECRET_ENV = "SLURMGATE_WEBHOOK_SECRET"
WEBHOOK_EPILOG = (
    "Example: SLURMGATE_WEBHOOK_SECRET=... PREFECT_API_URL=http://127.0.0.1:4200/api "
    "slurmgate webhook --port 8788  (GitHub: payload URL http://HOST:8788/webhook, "
    "content type application/json, event 'Workflow jobs')"
)


app = typer.Typer()


@app.command("webhook", epilog=WEBHOOK_EPILOG)
def webhook(
    port: Annotated[int, typer.Option(help="TCP port to listen on (0 picks a free one).")] = 8788,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    prefect_api_url: Annotated[
        str | None,
        typer.Option(envvar="PREFECT_API_URL", help="Prefect API, e.g. http://127.0.0.1:4200/api."),
    ] = None,
    secret_file: Annotated[
        Path | None,
        typer.Option(help=f"Read the webhook secret from this file (else ${SECRET_ENV})."),
    ] = None,
    max_age: Annotated[
        float, typer.Option(help="Reject deliveries whose job timestamp is older (seconds).")
    ] = 600.0,
    # the limits default to RelaySettings' own (None: not given); the help says what they are
    max_body_bytes: Annotated[
        int | None,
        typer.Option(help="Refuse larger workflow_job bodies (413). Default 1 MiB."),
    ] = None,
    max_buffered_bytes: Annotated[
        int | None,
        typer.Option(help="Bytes of bodies held at once, all requests (503). Default 64 MiB."),
    ] = None,
    body_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds a whole body may take to arrive (408). Default 10."),
    ] = None,
    header_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds request headers may take (then closed). Default 10."),
    ] = None,
    max_connections: Annotated[
        int | None, typer.Option(help="Open connections served at once (503). Default 64.")
    ] = None,
    job_store: Annotated[
        Path | None,
        typer.Option(
            envvar="SLURMGATE_JOB_STORE",
            help="Also write each job's state to this SQLite job-event store, which the "
            "reconcile tick on this host reads its jobs from (give it the same path).",
        ),
    ] = None,
) -> None:
    """Relay signed GitHub workflow_job webhooks into Prefect events (github.workflow_job.*).

    Serve it behind a TLS reverse proxy (docs/webhook.md); it binds to loopback by default.
    """
    from slurmgate.github.webhook import RelaySettings, create_app, server_options

    if not 0 <= port <= 65535:
        raise fail(f"--port {port} is not a TCP port; use 0..65535")
    if secret_file is not None:
        try:
            secret = secret_file.read_text().strip()
        except OSError as exc:
            raise fail(f"--secret-file {secret_file}: cannot read ({exc.strerror})") from None
    else:
        secret = (GitHubSettings.text("webhook_secret") or "").strip()
    if not secret:
        raise fail(f"no webhook secret: export {SECRET_ENV} or pass --secret-file")
    if not prefect_api_url:
        raise fail("no Prefect API: export PREFECT_API_URL or pass --prefect-api-url")
    auth = (PrefectSettings.text("api_auth_string") or "").strip() or None
    limits = {
        "max_body_bytes": max_body_bytes,
        "max_buffered_bytes": max_buffered_bytes,
        "body_timeout_s": body_timeout,
        "header_timeout_s": header_timeout,
        "max_connections": max_connections,
    }
    try:
        settings = RelaySettings(
            secret=secret,  # type: ignore[arg-type]
            prefect_api_url=prefect_api_url,
            prefect_auth_string=auth,  # type: ignore[arg-type]
            max_age_s=max_age,
            job_store=job_store,
            **{name: value for name, value in limits.items() if value is not None},
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first.get("loc", ())) or "settings"
        raise fail(f"{field}: {first.get('msg')}") from None
    import socket

    import uvicorn

    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)  # accept into the backlog at once; uvicorn serves them when it is up
    except OSError as exc:
        raise fail(
            f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port"
        ) from None
    bound = sock.getsockname()[1]
    # bind first, then announce the real URL: `--port 0` is usable by scripts and tests
    typer.echo(
        f"webhook relay on http://{host}:{bound}/webhook -> {settings.prefect_api_url}", err=True
    )
    config = uvicorn.Config(
        create_app(settings),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        **server_options(settings),
    )
    uvicorn.Server(config).run(sockets=[sock])
