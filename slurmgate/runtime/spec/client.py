"""The client workload: its command, CPUs and env, run on the client host against the endpoints."""

from __future__ import annotations

from pydantic import Field, field_validator

from slurmgate.runtime.spec.errors import problem
from slurmgate.runtime.spec.fields import StrictModel
from slurmgate.runtime.spec.secret_refs import (
    REFERENCE_FIX,
    EnvValue,
    checked_env,
    credential_flag,
)


class ClientSpec(StrictModel):
    """The zero-GPU client workload, run on the client host with the endpoint URLs in its env."""

    command: list[str] = Field(min_length=1)
    cpus: int | None = Field(
        default=None,
        ge=1,
        description="CPUs of the client step; default: the seed's 32, or fewer when the "
        "allocation holds fewer on the client node",
    )
    env: dict[str, EnvValue] = Field(default_factory=dict)
    dedicated_node: bool = Field(
        default=False,
        description="False: the client shares the first node of the first deployment",
    )

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str]) -> list[str]:
        found = credential_flag(v)
        if found is not None:
            raise problem(
                "command",
                f"{found} carries a credential, which would be stored in Prefect with the spec "
                "and shown in the client host's process list",
                f"give it to the client's env as {REFERENCE_FIX} and use $NAME in a script; "
                "the endpoint's token is in $SLURMGATE_ENDPOINT_TOKEN",
            )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, EnvValue]) -> dict[str, EnvValue]:
        return checked_env(v, lanes=False)
