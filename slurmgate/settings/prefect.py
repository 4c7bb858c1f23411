"""Prefect settings slurmgate reads itself: how long to wait for the API, and Prefect's own few."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr

from slurmgate.settings.part import Part, variable


class PrefectSettings(Part):
    """Prefect's variables as slurmgate's commands read them (Prefect reads its own as well)."""

    api_wait_s: float = variable(
        "SLURMGATE_PREFECT_API_WAIT_S",
        "Seconds a command waits for the configured Prefect API to answer (0: no wait).",
        60.0,
        ge=0,
    )
    api_url: str | None = variable(
        "PREFECT_API_URL",
        "Prefect's API (`slurmgate webhook --prefect-api-url` reads it); unset, a flow "
        "command starts a temporary server.",
    )
    api_auth_string: SecretStr | None = variable(
        "PREFECT_API_AUTH_STRING",
        "Prefect's API auth string, which `slurmgate webhook` sends with its events.",
    )
    home: Path | None = variable(
        "PREFECT_HOME",
        "Prefect's home; the demo's temporary server keeps its database there.",
    )
    database_template: Path | None = variable(
        "SLURMGATE_PREFECT_DB_TEMPLATE",
        "A migrated Prefect SQLite database copied into an empty PREFECT_HOME before a temporary "
        "server starts there, sparing its ~10 s of migrations (the test command sets it).",
    )
    ephemeral_startup_timeout_s: float = variable(
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
        "Seconds Prefect waits for a temporary server to start (Prefect's own setting).",
        20.0,
        gt=0,
    )
    server_analytics_enabled: bool = variable(
        "PREFECT_SERVER_ANALYTICS_ENABLED",
        "Prefect's server telemetry: our temporary servers keep it off unless this is true.",
        False,
    )
