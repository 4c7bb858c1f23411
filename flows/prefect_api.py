"""Which Prefect API a command's flow runs go to: the configured one, checked, or a temporary one.

Prefect starts its temporary server on first use, silently, for about twenty seconds, and the
runs, logs and artifacts in it vanish with the command. The commands that run a flow call
`use_prefect_api` first: it says in one line where the runs go and, when that is the temporary
server, starts it with progress on stderr (Prefect then reuses it and stops it at exit).
"""

from __future__ import annotations

import base64
import logging
import os
import sys
import time

from slurmgate.errors import ExternalError
from slurmgate.prefect_db import DATABASE_NAME, seed_prefect_database
from slurmgate.progress import progress
from slurmgate.settings.prefect import PrefectSettings

TEMPORARY_SERVER = (
    "a temporary local Prefect server (its runs, logs and artifacts vanish when this command "
    "exits; set PREFECT_API_URL, and PREFECT_API_AUTH_STRING if the server has one, to keep them)"
)
API_LINE = "prefect: flow runs go to {where}"
# How long a Prefect API that refuses connections may take to come up (a server just started);
# SLURMGATE_PREFECT_API_WAIT_S=0 fails at once.
API_WAIT_ENV = "SLURMGATE_PREFECT_API_WAIT_S"
API_WAIT_S = 60.0

# Prefect's temporary server needs ~20 s to start on a 2-core login node (its imports alone take
# 7 s), which is exactly Prefect's default limit; set before Prefect reads its settings.
EPHEMERAL_STARTUP_TIMEOUT_S = "90"

# Prefect sends anonymous usage data unless told not to: offline its server logs an ERROR per
# failed heartbeat, and on a fresh SQLite database the heartbeat's first write can collide with
# the flow's own writes ("database is locked", a traceback). Off unless the user set them.
TELEMETRY_OFF = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def prefect_defaults() -> None:
    """Our commands' Prefect defaults (a longer temporary-server start, telemetry off), unless the
    user set them; called before anything imports prefect, since Prefect reads them once."""
    os.environ.setdefault(
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EPHEMERAL_STARTUP_TIMEOUT_S
    )
    for name, value in TELEMETRY_OFF.items():
        os.environ.setdefault(name, value)


class PrefectApiError(ExternalError):
    """The Prefect API the command would use does not answer, or refuses it."""


class _TemporaryServerNotices(logging.Filter):
    """Drop Prefect's own start and stop notices of its temporary server: our line says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Starting temporary server", "Stopping temporary server"))


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _api_wait_s() -> float:
    raw = PrefectSettings.text("api_wait_s") or ""
    try:
        return max(0.0, float(raw)) if raw else API_WAIT_S
    except ValueError:
        raise PrefectApiError(
            f"{API_WAIT_ENV}={raw!r} is not a number of seconds; unset it or give e.g. 60"
        ) from None


def _probe(url: str, headers: dict[str, str]) -> int:
    """The status of a one-flow read: /health would answer without credentials."""
    import httpx

    response = httpx.post(
        url.rstrip("/") + "/flows/filter", json={"limit": 1}, headers=headers, timeout=10.0
    )
    return response.status_code


def _check_api(url: str, headers: dict[str, str]) -> None:
    """Raise a one-line PrefectApiError unless `url` lets us read flows. A server that refuses
    connections may still be starting (`prefect server start --background` returns at once):
    wait for it, with progress, up to API_WAIT_S."""
    import httpx

    fix = "start it (prefect server start) or point PREFECT_API_URL at a running server"
    try:
        try:
            status = _probe(url, headers)
        except httpx.ConnectError:
            with progress(f"prefect: waiting for the Prefect API at {url} to answer"):
                deadline = time.monotonic() + _api_wait_s()
                while True:
                    if time.monotonic() > deadline:
                        raise httpx.ConnectError("connection refused") from None
                    time.sleep(1.0)
                    try:
                        status = _probe(url, headers)
                        break
                    except httpx.ConnectError:
                        pass
    except httpx.HTTPError as exc:
        raise PrefectApiError(
            f"the Prefect API at {url} does not answer ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    if status in (401, 403):
        raise PrefectApiError(
            f"the Prefect API at {url} refused our credentials ({status}); set "
            "PREFECT_API_AUTH_STRING to the server's user:password (PREFECT_API_KEY for Prefect "
            "Cloud)"
        )
    if status in (404, 405):
        raise PrefectApiError(
            f"{url} answered {status} to a read of its flows: not a Prefect API; point "
            "PREFECT_API_URL at one, e.g. http://127.0.0.1:4200/api (it ends in /api)"
        )
    if status != 200:
        raise PrefectApiError(
            f"the Prefect API at {url} answered {status} to a read of its flows; {fix}"
        )


def use_prefect_api() -> None:
    """Say which Prefect API this command's flow runs go to: the configured one (checked), or
    Prefect's temporary server, started here with progress (Prefect reuses it, and stops it
    when the process exits)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        _say(API_LINE.format(where=f"the Prefect API at {settings.api.url}"))
        # the credentials Prefect's own client sends: a basic auth string, or a Cloud API key
        headers = {}
        if settings.api.auth_string:
            token = base64.b64encode(settings.api.auth_string.get_secret_value().encode())
            headers["Authorization"] = f"Basic {token.decode()}"
        elif settings.api.key:
            headers["Authorization"] = f"Bearer {settings.api.key.get_secret_value()}"
        _check_api(settings.api.url, headers)
        return
    _say(API_LINE.format(where=TEMPORARY_SERVER))
    prefect_logger = logging.getLogger("prefect")
    if not any(isinstance(f, _TemporaryServerNotices) for f in prefect_logger.filters):
        prefect_logger.addFilter(_TemporaryServerNotices())
    with progress("prefect: starting a temporary Prefect server"):
        from prefect.server.api.server import SubprocessASGIServer

        url = settings.server.database.connection_url
        database = url.get_secret_value() if url else ""
        if database == f"sqlite+aiosqlite:///{settings.home / DATABASE_NAME}":  # Prefect's default
            seed_prefect_database(settings.home)

        try:
            SubprocessASGIServer().start()
        except Exception as exc:
            limit = PrefectSettings.environ().get(
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "20"
            )
            raise PrefectApiError(
                f"the temporary Prefect server did not start ({' '.join(str(exc).split())[:300]})"
                f"; raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (now {limit} s) or "
                "point PREFECT_API_URL at a running server (prefect server start)"
            ) from None
