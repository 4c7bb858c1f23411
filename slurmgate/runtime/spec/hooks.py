"""The site's hooks: a prolog and an epilog of shell commands around a run, each time-limited."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from slurmgate.runtime.redact import literal_credential
from slurmgate.runtime.spec.errors import problem
from slurmgate.runtime.spec.fields import ENV_NAME, StrictModel
from slurmgate.runtime.spec.secret_refs import REFERENCE_FIX, EnvValue, checked_env

MAX_HOOK_COMMANDS = 32
MAX_HOOK_COMMAND_CHARS = 4096
MAX_HOOK_TIMEOUT_S = 86400.0


class HookSpec(StrictModel):
    """Shell commands a site runs on the controller's host around the run, with a time limit."""

    commands: list[str] = Field(
        description="one bash script, in order; the first command that fails stops it"
    )
    timeout_s: float = Field(
        default=600.0, description="then every process of the hook is stopped (≤ 86400)"
    )
    env: dict[str, EnvValue] = Field(
        default_factory=dict,
        description="the hook's own variables (a credential as {secret: BLOCK} or {from_env: "
        "NAME}); the hook sees no other variable that reads as a credential",
    )

    @field_validator("commands")
    @classmethod
    def _commands(cls, v: list[str]) -> list[str]:
        if not v:
            raise problem("commands", "is empty", "give at least one shell command")
        if len(v) > MAX_HOOK_COMMANDS:
            raise problem(
                "commands",
                f"{len(v)} commands, more than {MAX_HOOK_COMMANDS}",
                "put them in a script on the host and call it",
            )
        for i, command in enumerate(v):
            if not command.strip():
                raise problem("commands", f"command {i} is empty", "remove it")
            if len(command) > MAX_HOOK_COMMAND_CHARS:
                raise problem(
                    "commands",
                    f"command {i} is longer than {MAX_HOOK_COMMAND_CHARS} characters",
                    "put it in a script on the host and call it",
                )
            if "\0" in command:
                raise problem("commands", f"command {i} contains a NUL byte", "remove it")
            kind = literal_credential(command)
            if kind is not None:
                raise problem(
                    "commands",
                    f"command {i} holds {kind}, which would be stored in Prefect with the spec",
                    f"give it to the hook's env as NAME: {REFERENCE_FIX} and use $NAME in the "
                    "command",
                )
        return v

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not 0 < v <= MAX_HOOK_TIMEOUT_S:
            raise problem(
                "timeout_s",
                f"{v:g} is not a time limit in seconds",
                f"give seconds above 0, at most {MAX_HOOK_TIMEOUT_S:g} (a day)",
            )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, EnvValue]) -> dict[str, EnvValue]:
        for key in v:
            if not ENV_NAME.match(key):
                raise problem("env", f"{key!r} is not a variable name", "use letters, digits and _")
            if key.startswith("SLURMGATE_") or key == "SLURM_JOB_ID":
                raise problem("env", f"{key} is set by the runtime", f"remove {key}")
        return checked_env(v, lanes=False)


class HooksSpec(StrictModel):
    """Site steps on the controller's host: `prolog` before preflight, `epilog` after cleanup."""

    prolog: HookSpec | None = Field(
        default=None,
        description="after the allocation is granted and before the preflight: a failure "
        "stops the run before anything is launched",
    )
    epilog: HookSpec | None = Field(
        default=None,
        description="after cleanup, on every path; a failure is reported in the run's "
        "result and record but does not fail the run",
    )

    @field_validator("prolog", "epilog", mode="before")
    @classmethod
    def _shape(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str | list):
            raise problem(
                str(info.field_name),
                "is not a mapping",
                f"write it as {info.field_name}: {{commands: [COMMAND, ...], timeout_s: 600}}",
            )
        return v

    def named(self) -> dict[str, HookSpec]:
        """The hooks the spec sets, by name."""
        hooks = {"prolog": self.prolog, "epilog": self.epilog}
        return {name: hook for name, hook in hooks.items() if hook is not None}
