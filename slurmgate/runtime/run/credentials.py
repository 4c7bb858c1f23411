"""A run's credentials: the spec's secret references, resolved on the client host when it starts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pydantic import SecretStr

from slurmgate.errors import InputError
from slurmgate.runtime.redact import Redactor
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.secret_refs import EnvSecretRef, EnvValue, SecretBlockRef, SecretValue
from slurmgate.settings.handed import named

# Reads a Prefect Secret block by name. The core never imports Prefect: the Prefect layer
# passes this in, and a run without it cannot resolve `{secret: NAME}`.
SecretResolver = Callable[[str], str]


class SecretUnresolved(InputError):
    """A secret reference of the spec names nothing this host can read."""


def resolve_secret(where: str, value: SecretValue, resolver: SecretResolver | None) -> str:
    """The value behind one reference; the error names the field and the fix, never a value."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, EnvSecretRef):
        found = named(value.from_env)
        if found is None:
            raise SecretUnresolved(
                f"{where}: the controller has no variable {value.from_env} — set it where "
                "the run starts, or reference a Prefect Secret block with {secret: NAME}"
            )
        return found
    if resolver is None:
        raise SecretUnresolved(
            f"{where}: Secret block {value.secret!r} needs Prefect — run the spec through "
            "`slurmgate allocation run`, or use {from_env: NAME}"
        )
    try:
        return resolver(value.secret)
    except Exception as exc:  # the block may be missing, or Prefect unreachable
        raise SecretUnresolved(
            f"{where}: cannot read Secret block {value.secret!r} ({type(exc).__name__}) — "
            "create it, or check its name"
        ) from None


def resolve_env(
    where: str, env: Mapping[str, EnvValue], resolver: SecretResolver | None
) -> dict[str, str]:
    return {
        key: value if isinstance(value, str) else resolve_secret(f"{where}.{key}", value, resolver)
        for key, value in env.items()
    }


@dataclass(frozen=True)
class RunCredentials:
    """Every environment value a run hands its steps, resolved; and a redactor for them all."""

    client_env: dict[str, str] = field(default_factory=dict)
    deployment_env: tuple[dict[str, str], ...] = ()
    endpoint_token: str | None = None
    hook_env: dict[str, dict[str, str]] = field(default_factory=dict)
    secret_values: frozenset[str] = frozenset()

    @classmethod
    def resolve(
        cls, spec: AllocationSpec, resolver: SecretResolver | None = None
    ) -> RunCredentials:
        secrets: set[str] = set()
        client = resolve_env("client.env", spec.client.env, resolver)
        secrets |= {client[k] for k, v in spec.client.env.items() if not isinstance(v, str)}
        deployments = []
        for i, d in enumerate(spec.deployments):
            env = resolve_env(f"deployments[{i}].env", d.env, resolver)
            secrets |= {env[k] for k, v in d.env.items() if not isinstance(v, str)}
            deployments.append(env)
        hooks = {}
        for name, hook in spec.hooks.named().items():
            hooks[name] = resolve_env(f"hooks.{name}.env", hook.env, resolver)
            secrets |= {hooks[name][k] for k, v in hook.env.items() if not isinstance(v, str)}
        token = None
        if spec.endpoint_token is not None:
            token = resolve_secret("endpoint_token", spec.endpoint_token, resolver)
            if not token:
                raise SecretUnresolved("endpoint_token: the token is empty — give it a value")
            secrets.add(token)
        return cls(
            client_env=client,
            deployment_env=tuple(deployments),
            endpoint_token=token,
            hook_env=hooks,
            secret_values=frozenset(secrets),
        )

    def redactor(self) -> Redactor:
        return Redactor(self.secret_values)


__all__ = [
    "RunCredentials",
    "SecretBlockRef",
    "SecretResolver",
    "SecretUnresolved",
    "resolve_env",
    "resolve_secret",
]
