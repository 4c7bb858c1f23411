"""What every part of the settings tree shares: its variables by name, read or picked from a map."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict


def variable(name: str, description: str, default: Any = None, **bounds: Any) -> Any:
    """A field read from the environment variable `name`, exactly as written (its own name in
    keyword arguments too), with its default and one line of doc."""
    return Field(default=default, validation_alias=name, description=description, **bounds)


class Part(BaseSettings):
    """A part of the tree whose fields are environment variables named in full (`variable`).

    The model says each variable's type, default and meaning (the settings reference is built
    from it). Where a value is used, it is read as the operator wrote it (`text`, `environ`) and
    parsed there, so a bad value's error names the variable and the fix as it always has, and a
    bad value of one variable never stops a reader of another.
    """

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True, case_sensitive=True)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The environment variables of this part, in declaration order."""
        return tuple(str(f.validation_alias) for f in cls.model_fields.values())

    @classmethod
    def environ(cls, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables of this part that are set, by name, as written: read from this
        process's environment, or picked out of `env` (a test's, or one built for a child)."""
        if env is None:
            env = {k: str(v) for k, v in EnvSettingsSource(cls)().items() if v is not None}
        return {name: env[name] for name in cls.names() if name in env}

    @classmethod
    def text(cls, field: str, env: Mapping[str, str] | None = None) -> str | None:
        """One field's variable as written (None when it is not set)."""
        return cls.environ(env).get(str(cls.model_fields[field].validation_alias))
