"""The spec's shared ground: its strict model base, checked names, ports and variable names."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from slurmgate.runtime.endpoint.config import TOKEN_ENV
from slurmgate.runtime.spec.errors import problem

# Environment names the runtime owns for every lane.
RESERVED_ENV_PREFIXES = ("SLURM_", "SLURMGATE_RUN_")
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", TOKEN_ENV)
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _checked_name(v: str, what: str) -> str:
    if not _NAME.match(v):
        raise problem(
            "name",
            f"{v!r} is not a valid {what} name",
            "use lowercase letters, digits and dashes, starting with a letter (≤ 40)",
        )
    return v


def _named(what: str) -> AfterValidator:
    return AfterValidator(lambda v: _checked_name(v, what))


DeploymentName = Annotated[str, _named("deployment")]
AllocationName = Annotated[str, _named("allocation")]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def port_field(default: int, description: str) -> Any:
    return Field(default=default, ge=1024, le=65535, description=description)
