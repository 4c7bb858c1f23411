"""The allocation spec's root: a strict, versioned description of the client and its deployments."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from slurmgate.runtime.engines.layout import mooncake_problems, port_problems
from slurmgate.runtime.spec.client import ClientSpec
from slurmgate.runtime.spec.deployment import DeploymentSpec
from slurmgate.runtime.spec.errors import SpecError, problem, spec_error_from
from slurmgate.runtime.spec.fields import AllocationName, StrictModel
from slurmgate.runtime.spec.hooks import HooksSpec
from slurmgate.runtime.spec.secret_refs import SecretValue, describe_secret
from slurmgate.runtime.spec.slurm_options import SlurmSpec

_TIME_LIMIT = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$")


class AllocationSpec(StrictModel):
    """The whole allocation: one client and one or more deployments."""

    schema_version: Literal[1] = 1
    name: AllocationName
    client: ClientSpec
    deployments: list[DeploymentSpec] = Field(min_length=1)
    gpus_per_node: int = Field(default=8, ge=0, description="GPUs each node has")
    model_path: str | None = Field(default=None, description="checked readable on every node")
    time_limit: str = Field(default="03:55:00", description="[D-]HH:MM:SS for an owned allocation")
    slurm: SlurmSpec = Field(
        default_factory=SlurmSpec,
        description="partition, account, QOS, reservation and constraint of the allocation a "
        "run requests itself",
    )
    python: str | None = Field(
        default=None,
        description="the interpreter the node workers, probe and endpoint steps run as, at "
        "this path on every node, with slurmgate installed (default: the controller's own)",
    )
    endpoint_token: SecretValue | None = Field(
        default=None,
        description="bearer token every logical endpoint requires (GET /health aside); the "
        "client gets it as SLURMGATE_ENDPOINT_TOKEN",
    )
    hooks: HooksSpec = Field(
        default_factory=HooksSpec,
        description="site shell steps on the controller's host: prolog before the preflight, "
        "epilog after cleanup, each with its timeout; their output goes to the run's log",
    )

    @field_validator("time_limit")
    @classmethod
    def _time_limit(cls, v: str) -> str:
        if not _TIME_LIMIT.match(v):
            raise problem("time_limit", f"{v!r} is not a Slurm time", "use [D-]HH:MM:SS")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or any(c.isspace() for c in v)):
            raise problem(
                "python",
                f"{v!r} is not an absolute path",
                "give the interpreter's full path on the compute nodes, e.g. "
                "/shared/venvs/slurmgate/bin/python",
            )
        return v

    @model_validator(mode="after")
    def _whole(self) -> AllocationSpec:
        names = [d.name for d in self.deployments]
        for i, d in enumerate(self.deployments):
            if names.index(d.name) != i:
                raise problem(
                    f"deployments[{i}].name", f"{d.name!r} is used twice", "give each a name"
                )
            if d.roles is not None:
                for f, m, fix in d.role_problems(self.gpus_per_node):
                    raise problem(f"deployments[{i}].{f}", m, fix)
                continue
            used = d.used_gpus_per_node(self.gpus_per_node)
            if used > self.gpus_per_node:
                raise problem(
                    f"deployments[{i}].gpus_per_node",
                    f"{used} GPUs per node but a node has {self.gpus_per_node}",
                    "lower it, or raise the allocation's gpus_per_node if the nodes have more",
                )
            lanes = d.lanes_for(self.gpus_per_node)
            need = lanes * d.gpus_per_lane
            if need > used:
                per_lane = f"tensor_parallel {d.tensor_parallel}"
                if d.data_parallel > 1:
                    per_lane = f"{d.gpus_per_lane} GPUs (data-parallel ranks × {per_lane})"
                raise problem(
                    f"deployments[{i}].lanes_per_node",
                    f"{lanes} lanes × {per_lane} = {need} GPUs, "
                    f"but the deployment has {used} per node: a GPU would be shared by two lanes",
                    "lower lanes_per_node, tensor_parallel or data_parallel, or raise "
                    "gpus_per_node",
                )
        # Port collisions are a layout question: the same plan the runtime uses decides them.
        problems = port_problems(self) + mooncake_problems(self)
        if problems:
            f, m, fix = problems[0]
            raise problem(f, m, fix)
        return self

    def secret_references(self) -> list[str]:
        """Where the spec references credentials, as `field: reference` (never a value)."""
        found = []
        envs = [("client.env", self.client.env)] + [
            (f"deployments[{i}].env", d.env) for i, d in enumerate(self.deployments)
        ]
        envs += [(f"hooks.{name}.env", hook.env) for name, hook in self.hooks.named().items()]
        for where, env in envs:
            found += [
                f"{where}.{k}: {describe_secret(v)}"
                for k, v in env.items()
                if not isinstance(v, str)
            ]
        if self.endpoint_token is not None:
            found.append(f"endpoint_token: {describe_secret(self.endpoint_token)}")
        return found

    @property
    def total_nodes(self) -> int:
        """Nodes the allocation needs (what `nodes:N` asks for on the admission side)."""
        return sum(d.nodes_for(self.gpus_per_node) for d in self.deployments) + (
            1 if self.client.dedicated_node else 0
        )

    @classmethod
    def from_data(cls, data: Any, source: str = "spec") -> AllocationSpec:
        """Validate plain data; raises SpecError with readable problems."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise spec_error_from(exc, source) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> AllocationSpec:
        from slurmgate.documents import DocumentError, read_yaml

        p = Path(path)
        try:
            data = read_yaml(p)
        except DocumentError as exc:
            raise SpecError([(str(p), exc.problem, exc.fix)]) from None
        return cls.from_data(data, source=str(p))
