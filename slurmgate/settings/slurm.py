"""Slurm settings: where slurmrestd answers the capacity read, and as whom."""

from __future__ import annotations

import ipaddress
import re

import httpx
from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class SlurmRestSettings(BaseSettings):
    """Where slurmrestd answers, and as whom (environment `SLURMGATE_SLURMRESTD_<NAME>`)."""

    model_config = SettingsConfigDict(env_prefix="SLURMGATE_SLURMRESTD_", extra="ignore")

    user: str | None = Field(default=None, description="X-SLURM-USER-NAME for auth/jwt.")
    token: SecretStr | None = Field(
        default=None, description="X-SLURM-USER-TOKEN for auth/jwt (`scontrol token`)."
    )
    url: str | None = Field(
        default=None,
        description="slurmrestd's address: http(s)://host:port (auth/jwt) or unix:/path "
        "(rest_auth/local). Unset: the capacity read runs scontrol and squeue.",
    )
    api_version: str = Field(
        default="v0.0.38",
        description="The OpenAPI plugin to ask (v0.0.38 is Slurm 22.05's newest; later Slurm "
        "releases serve later ones: see `slurmrestd -s list`).",
    )
    timeout_s: float = Field(
        default=10.0, gt=0, le=120, description="Seconds one slurmrestd request may take."
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None, info: ValidationInfo) -> str | None:
        # checked here, after the token (declared first), so no error ever shows the token
        if value is None or not value.strip():
            return None
        value = value.strip()
        if not (value.startswith("unix:/") or re.match(r"^https?://[^/\s]+/?$", value)):
            raise ValueError(
                f"SLURMGATE_SLURMRESTD_URL {value[:80]!r} is not slurmrestd's address; give "
                "http(s)://host:port or unix:/path/to/socket"
            )
        if info.data.get("token") is not None and value.startswith("http://"):
            host = httpx.URL(value).host
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = host == "localhost"
            if not loopback:
                raise ValueError(
                    f"SLURMGATE_SLURMRESTD_URL {value[:80]!r} is plain http to another host, "
                    "and the token would cross the network in clear; use https:// (or a "
                    "unix: socket)"
                )
        return value.rstrip("/")

    @field_validator("api_version")
    @classmethod
    def _version(cls, value: str) -> str:
        if not re.fullmatch(r"v0\.0\.\d{2}", value):
            raise ValueError(
                f"SLURMGATE_SLURMRESTD_API_VERSION {value[:40]!r} is not a slurmrestd plugin "
                "version; give one like v0.0.38"
            )
        return value
