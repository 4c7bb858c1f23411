"""Allocation presets: a spec file on the worker's host, with a few of its fields overridden.

The allocation deployment's full spec is a form of a dozen kilobytes in the Prefect UI, retyped
for every run. A preset names a spec file that lives on the host of the worker that runs the
flow (the site's checked-in specs), and `SpecOverrides` are the handful of fields people change
between runs; the result is validated as a whole, like a spec given in full.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError, spec_error_from
from slurmgate.runtime.spec.fields import AllocationName

# A spec is a few kilobytes; a path that names something far larger is not one.
MAX_SPEC_FILE_BYTES = 1 << 20


class SpecOverrides(BaseModel):
    """Fields of a preset's spec to replace for one run; unset fields keep the file's values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: AllocationName | None = Field(default=None, description="the run's name")
    time_limit: str | None = Field(default=None, description="Slurm time limit, e.g. 01:00:00")
    partition: str | None = Field(default=None, description="Slurm partition")
    account: str | None = Field(default=None, description="Slurm account")
    qos: str | None = Field(default=None, description="Slurm QOS")
    reservation: str | None = Field(default=None, description="Slurm reservation")
    replicas: dict[str, int] = Field(
        default_factory=dict, description="replicas per deployment name, e.g. {chat: 4}"
    )
    client_command: list[str] | None = Field(
        default=None, min_length=1, description="the client's argv"
    )

    def is_empty(self) -> bool:
        return self == SpecOverrides()


def load_spec_file(path: str) -> AllocationSpec:
    """The spec in `path` on this host; errors name the `spec_file` field and the fix."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        raise SpecError([("spec_file", f"{path!r} is relative", "give an absolute path")])
    try:
        size = p.stat().st_size
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise SpecError(
            [("spec_file", f"{path} cannot be read on this host ({reason})", "check the path")]
        ) from None
    if size > MAX_SPEC_FILE_BYTES:
        raise SpecError(
            [("spec_file", f"{path} is {size} bytes, over {MAX_SPEC_FILE_BYTES}", "name a spec")]
        )
    return AllocationSpec.from_yaml(p)


def apply_overrides(spec: AllocationSpec, overrides: SpecOverrides) -> AllocationSpec:
    """`spec` with `overrides` applied, validated again as a whole spec."""
    data: dict[str, Any] = spec.model_dump(exclude_unset=True)
    if overrides.name is not None:
        data["name"] = overrides.name
    if overrides.time_limit is not None:
        data["time_limit"] = overrides.time_limit
    site = dict(data.get("slurm") or {})
    for key in ("partition", "account", "qos", "reservation"):
        value = getattr(overrides, key)
        if value is not None:
            site[key] = value
    if site:
        data["slurm"] = site
    names = [d["name"] for d in data["deployments"]]
    unknown = sorted(set(overrides.replicas) - set(names))
    if unknown:
        raise SpecError(
            [
                (
                    "overrides.replicas",
                    f"no deployment named {', '.join(unknown)}",
                    f"use one of {', '.join(names)}",
                )
            ]
        )
    for deployment in data["deployments"]:
        if deployment["name"] in overrides.replicas:
            deployment["replicas"] = overrides.replicas[deployment["name"]]
    if overrides.client_command is not None:
        data["client"] = {**data["client"], "command": list(overrides.client_command)}
    try:
        return AllocationSpec.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from(exc, source="overrides") from None


def resolve_spec(
    spec: AllocationSpec | None, spec_file: str | None, overrides: SpecOverrides | None
) -> AllocationSpec:
    """The run's spec from exactly one of a full `spec` or a `spec_file`, then the overrides."""
    if (spec is None) == (spec_file is None):
        raise SpecError(
            [
                (
                    "spec",
                    "give exactly one of spec (in full) or spec_file (a preset on this host)",
                    "set one and leave the other empty",
                )
            ]
        )
    chosen = spec if spec is not None else load_spec_file(str(spec_file))
    if overrides is None or overrides.is_empty():
        return chosen
    return apply_overrides(chosen, overrides)
