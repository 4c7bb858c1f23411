"""Which Prefect API a command's flow runs go to: the configured one, checked, or a temporary one.

Prefect starts its temporary server on first use, silently, for about twenty seconds, and the
runs, logs and artifacts in it vanish with the command. The commands that run a flow call
`use_prefect_api` first: it says in one line where the runs go and, when that is the temporary
server, starts it with progress on stderr (Prefect then reuses it and stops it at exit).
"""

from __future__ import annotations

import logging
import os
import sys

from slurmgate.cli.progress import progress
from slurmgate.errors import ExternalError

TEMPORARY_SERVER = (
    "a temporary local Prefect server (its runs, logs and artifacts vanish when this command "
    "exits; set PREFECT_API_URL, and PREFECT_API_AUTH_STRING if the server has one, to keep them)"
)
API_LINE = "prefect: flow runs go to {where}"


class PrefectApiError(ExternalError):
    """The Prefect API the command would use does not answer, or refuses it."""


class _TemporaryServerNotices(logging.Filter):
    """Drop Prefect's own start and stop notices of its temporary server: our line says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Starting temporary server", "Stopping temporary server"))


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _check_api(url: str, auth_string: str | None) -> None:
    """Raise a one-line PrefectApiError unless `url`/health answers 200."""
    import httpx

    user, _, password = (auth_string or "").partition(":")
    auth = (user, password) if auth_string else None
    fix = "start it (prefect server start) or point PREFECT_API_URL at a running server"
    try:
        response = httpx.get(url.rstrip("/") + "/health", auth=auth, timeout=10.0)
    except httpx.HTTPError as exc:
        raise PrefectApiError(
            f"the Prefect API at {url} does not answer ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    if response.status_code == 401:
        raise PrefectApiError(
            f"the Prefect API at {url} wants credentials (401); set PREFECT_API_AUTH_STRING "
            "to the server's user:password"
        )
    if response.status_code != 200:
        raise PrefectApiError(
            f"the Prefect API at {url} answered {response.status_code} to /health; {fix}"
        )


def use_prefect_api() -> None:
    """Say which Prefect API this command's flow runs go to: the configured one (checked), or
    Prefect's temporary server, started here with progress (Prefect reuses it, and stops it
    when the process exits)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        _say(API_LINE.format(where=f"the Prefect API at {settings.api.url}"))
        auth = settings.api.auth_string
        _check_api(settings.api.url, auth.get_secret_value() if auth else None)
        return
    _say(API_LINE.format(where=TEMPORARY_SERVER))
    prefect_logger = logging.getLogger("prefect")
    if not any(isinstance(f, _TemporaryServerNotices) for f in prefect_logger.filters):
        prefect_logger.addFilter(_TemporaryServerNotices())
    with progress("prefect: starting a temporary Prefect server"):
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start()
        except Exception as exc:
            limit = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "20")
            raise PrefectApiError(
                f"the temporary Prefect server did not start ({' '.join(str(exc).split())[:300]})"
                f"; raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (now {limit} s) or "
                "point PREFECT_API_URL at a running server (prefect server start)"
            ) from None
