"""The Slurm options of an allocation the run requests itself: partition, account, QOS, …"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from slurmgate.runtime.spec.errors import problem
from slurmgate.runtime.spec.fields import StrictModel

# Slurm names of partitions, accounts and QOSes (a partition may be a comma list): no spaces,
# nothing that could read as another option.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}(,[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})*$")
# A Slurm constraint: features joined by & | , with brackets, counts (*N) and parentheses.
_SLURM_CONSTRAINT = re.compile(r"^[A-Za-z0-9_(\[][A-Za-z0-9_.&|,*()\[\]:-]{0,199}$")


def _slurm_name(field: str, v: str | None, example: str) -> str | None:
    if v is not None and not _SLURM_NAME.match(v):
        raise problem(
            field,
            f"{v!r} is not a Slurm {field} name",
            f"use the name `sinfo`/`sacctmgr` shows, e.g. {example}",
        )
    return v


class SlurmSpec(StrictModel):
    """Site options for the allocation the run requests itself (ignored inside SLURM_JOB_ID)."""

    partition: str | None = Field(
        default=None, description="salloc --partition (a comma list lets Slurm pick one)"
    )
    account: str | None = Field(default=None, description="salloc --account to charge")
    qos: str | None = Field(default=None, description="salloc --qos")
    reservation: str | None = Field(
        default=None,
        description="salloc --reservation: the reservation the run's pool is mapped to, when "
        "its nodes are the only ones the controller counted",
    )
    constraint: str | None = Field(
        default=None,
        description="salloc --constraint, e.g. mi300x or a&b: the feature the run's pool is "
        "mapped to",
    )

    @field_validator("reservation")
    @classmethod
    def _reservation(cls, v: str | None) -> str | None:
        return _slurm_name("reservation", v, "gpu-ci (`scontrol show reservation` lists them)")

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_CONSTRAINT.match(v):
            raise problem(
                "constraint",
                f"{v!r} is not a Slurm constraint",
                "use node features as `sinfo -o %f` shows them, joined by & or |, e.g. mi300x",
            )
        return v

    @field_validator("partition")
    @classmethod
    def _partition(cls, v: str | None) -> str | None:
        return _slurm_name("partition", v, "gpu or gpu,gpu-long")

    @field_validator("account")
    @classmethod
    def _account(cls, v: str | None) -> str | None:
        return _slurm_name("account", v, "my-project")

    @field_validator("qos")
    @classmethod
    def _qos(cls, v: str | None) -> str | None:
        return _slurm_name("qos", v, "normal")
