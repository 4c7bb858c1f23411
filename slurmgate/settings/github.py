"""GitHub settings: the credentials, the client's pace, the webhook secret, the job events."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from slurmgate.settings.part import Part, variable


class EventReadSettings(BaseSettings):
    """How the tick uses the relay's job events (environment `SLURMGATE_<NAME>`)."""

    model_config = SettingsConfigDict(env_prefix="SLURMGATE_", extra="ignore")

    full_read_every: int = Field(
        default=10,
        ge=1,
        le=10_000,
        description="With job events, every K-th snapshot read polls every run (the repair "
        "path for missed deliveries); 1 polls every time (env SLURMGATE_FULL_READ_EVERY).",
    )
    event_recheck_s: float = Field(
        default=120.0,
        gt=0,
        description="A job whose queued state nobody confirmed for this long is read by id "
        "(env SLURMGATE_EVENT_RECHECK_S, seconds).",
    )
    job_store: Path | None = Field(
        default=None,
        description="The relay's job-event store (env SLURMGATE_JOB_STORE; default "
        "job-events.sqlite in the state directory). Without the file the tick polls.",
    )


class GitHubSettings(Part):
    """How the commands and inline scopes reach GitHub: a token or an App, and their pace."""

    token: SecretStr | None = variable(
        "GITHUB_TOKEN",
        "The token of an inline scope and of `slurmgate init` (admin rights on the runners).",
    )
    app_id: int | None = variable(
        "SLURMGATE_GITHUB_APP_ID", "Authenticate as this GitHub App instead of a token."
    )
    app_private_key: SecretStr | None = variable(
        "SLURMGATE_GITHUB_APP_PRIVATE_KEY",
        "The App's private key as PEM text (`\\n` escapes accepted); or give its file.",
    )
    app_private_key_file: Path | None = variable(
        "SLURMGATE_GITHUB_APP_PRIVATE_KEY_FILE", "The path of the App's private key (.pem)."
    )
    app_installation_id: int | None = variable(
        "SLURMGATE_GITHUB_APP_INSTALLATION_ID",
        "The App's installation (unset: the one installed on the scope).",
    )
    min_write_interval_s: float | None = variable(
        "SLURMGATE_MIN_WRITE_INTERVAL_S",
        "An inline scope's least gap between two writes to GitHub, in seconds "
        "(unset: the scope block's default).",
    )
    request_retries: int | None = variable(
        "SLURMGATE_REQUEST_RETRIES",
        "An inline scope's retries of a failed GitHub request (unset: the scope block's default).",
    )
    webhook_secret: SecretStr | None = variable(
        "SLURMGATE_WEBHOOK_SECRET",
        "The secret `slurmgate webhook` checks each delivery's signature with (or --secret-file).",
    )
