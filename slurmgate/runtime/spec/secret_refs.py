"""Credentials in a spec: references to where they live, and the checks that keep values out.

A plain value would be stored in Prefect as a flow-run parameter, so a spec names a Prefect
Secret block or a controller variable instead; the run resolves it on the client host.
"""

from __future__ import annotations

from pydantic import Field, SecretStr

from slurmgate.runtime.endpoint.config import TOKEN_ENV
from slurmgate.runtime.redact import CREDENTIAL_FLAG, CREDENTIAL_NAME, literal_credential
from slurmgate.runtime.spec.errors import problem
from slurmgate.runtime.spec.fields import RESERVED_ENV, RESERVED_ENV_PREFIXES, StrictModel

# Names whose values are credentials: a plain value would be stored in Prefect as a flow-run
# parameter, so the spec must reference it instead.
SECRET_NAME = CREDENTIAL_NAME
REFERENCE_FIX = "{secret: BLOCK-NAME} or {from_env: NAME}"


class SecretBlockRef(StrictModel):
    """A Prefect Secret block, by name, read on the client host when the run starts."""

    secret: str = Field(min_length=1, description="name of a Prefect Secret block")


class EnvSecretRef(StrictModel):
    """A variable of the controller's own environment, read on the client host."""

    from_env: str = Field(min_length=1, description="name of the controller's variable")


# A credential in the spec: only its reference is ever stored (a SecretStr shows as ****).
SecretValue = SecretBlockRef | EnvSecretRef | SecretStr
EnvValue = str | SecretValue


def checked_env(v: dict[str, EnvValue], *, lanes: bool) -> dict[str, EnvValue]:
    for key, value in v.items():
        reserved = key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES)
        if (reserved and lanes) or key == TOKEN_ENV:
            raise problem("env", f"{key} is set by the runtime", f"remove {key}")
        if isinstance(value, str) and SECRET_NAME.search(key):
            raise problem(
                "env",
                f"{key} looks like a credential and its value would be stored in Prefect",
                f"reference it: {key}: {{secret: BLOCK-NAME}} or {key}: {{from_env: NAME}}",
            )
        kind = literal_credential(value) if isinstance(value, str) else None
        if kind is not None:
            raise problem(
                "env",
                f"the value of {key} holds {kind}, which would be stored in Prefect",
                f"give the credential its own variable as {REFERENCE_FIX} and refer to it",
            )
    return v


def describe_secret(value: SecretValue) -> str:
    """A reference as words, safe to log: never the value."""
    if isinstance(value, SecretBlockRef):
        return f"Secret block {value.secret!r}"
    if isinstance(value, EnvSecretRef):
        return f"controller variable {value.from_env}"
    return "a SecretStr value"


def credential_flag(argv: list[str]) -> str | None:
    """The first credential in `argv`, named without its value: a credential flag that carries
    one (--api-key K, --hf-token=V), or an argument holding a known credential shape (a
    token, a bearer header, a URL's password, in a `bash -c` string too)."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if CREDENTIAL_FLAG.match(name) and (
            value if eq else following and not following.startswith("-")
        ):
            return name
        kind = literal_credential(arg)
        if kind is not None:
            return f"argument {i} ({kind})"
    return None
