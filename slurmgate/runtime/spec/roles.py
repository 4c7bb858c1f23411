"""A deployment's roles: prefill and decode workers, or agg workers, in the engine's own sizes."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, field_validator, model_validator

from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.engines import roles as role_engines
from slurmgate.runtime.spec.errors import Problem, problem
from slurmgate.runtime.spec.fields import ENV_NAME, StrictModel
from slurmgate.runtime.spec.secret_refs import SECRET_NAME, checked_env, credential_flag

MAX_ROLE_WORKERS = 512
# InferenceX's AMD scripts list every CUDA-graph batch size of a DP decode (1 … 512) as its own
# argument: 559 arguments on the longest row, so a role takes up to 1024.
MAX_ROLE_ARGS = 1024
MAX_ROLE_ARG_CHARS = 16384
MAX_ENGINE_CONFIG_CHARS = 256 * 1024
ROLE_NAMES = role_engines.ROLE_NAMES


def checked_args(v: list[str]) -> list[str]:
    """A role's (or a frontend's) own flags: bounded, and no credential among them."""
    for i, arg in enumerate(v):
        if len(arg) > MAX_ROLE_ARG_CHARS or "\0" in arg:
            raise problem(
                "args",
                f"argument {i} is longer than {MAX_ROLE_ARG_CHARS} characters or holds a NUL byte",
                "shorten it (a large engine config goes in engine_config)",
            )
    flag = credential_flag(v)
    if flag is not None:
        raise problem(
            "args",
            f"{flag} carries a credential, which would be stored in Prefect with the spec "
            "and shown in every node's process list",
            f"remove {flag} and its value: give it to the deployment's env as "
            "{secret: BLOCK} or {from_env: NAME}",
        )
    return v


def checked_plain_env(v: dict[str, str]) -> dict[str, str]:
    """A role's (or a frontend's) own env: variable names with plain values, none the
    runtime's and none a credential."""
    for key in v:
        if not ENV_NAME.match(key):
            raise problem("env", f"{key!r} is not a variable name", "use letters, digits and _")
        if SECRET_NAME.search(key):
            raise problem(
                "env",
                f"{key} looks like a credential, and a role's env holds plain values only",
                f"move {key} to the deployment's env as {{secret: BLOCK-NAME}} or "
                "{from_env: NAME}",
            )
    checked_env(dict(v), lanes=True)
    return v


# DeploymentSpec fields that describe the classic replica shape; a deployment with roles
# gives each role its own sizes instead.
CLASSIC_SHAPE_FIELDS = (
    "tensor_parallel",
    "pipeline_parallel",
    "data_parallel",
    "replicas",
    "nodes_per_replica",
    "lanes_per_node",
    "gpus_per_node",
    "enable_expert_parallel",
)


class RoleSpec(StrictModel):
    """One role's workers, in the engine's own sizes: GPUs, flags and env of each worker."""

    workers: int = Field(
        default=1, ge=1, le=MAX_ROLE_WORKERS, description="independent workers of this role"
    )
    tensor_parallel: int = Field(
        default=1, ge=1, le=4096, description="the engine's tensor-parallel size of one worker"
    )
    data_parallel: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="the engine's data-parallel size of one worker (full copies, or attention "
        "groups inside the TP ranks with dp_attention)",
    )
    expert_parallel: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="the engine's expert-parallel size of one worker (SGLang: divides "
        "tensor_parallel; vLLM: tensor_parallel × data_parallel when on)",
    )
    pipeline_parallel: int = Field(
        default=1, ge=1, le=256, description="the engine's pipeline-parallel size of one worker"
    )
    dp_attention: bool = Field(
        default=False,
        description="data-parallel attention inside the TP group (SGLang --enable-dp-attention, "
        "TensorRT-LLM enable_attention_dp): the DP ranks add no GPUs",
    )
    gpus_per_worker: int | None = Field(
        default=None,
        ge=1,
        description="GPUs one worker takes; default: what its sizes need by the engine's rule "
        "(when set, it must agree: a recipe's gpus_per_<role>). Fewer than a node's GPUs "
        "packs workers on a node; more takes whole nodes",
    )
    nodes_per_worker: int | None = Field(
        default=None,
        ge=1,
        description="nodes one worker spans; default: its GPUs over the node's (when set, "
        "it must agree)",
    )
    workers_per_node: int | None = Field(
        default=None,
        ge=1,
        description="workers packed on one node, each on its own GPUs; default: as many as "
        "fit (1 spreads partial-node workers one per node, srt-slurm's spread_workers)",
    )
    args: list[str] = Field(
        default_factory=list,
        max_length=MAX_ROLE_ARGS,
        description="this role's engine flags, after the deployment's command and the "
        "launcher's flags (the launcher's own flags are refused here)",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="this role's processes only, plain values (a credential goes in the "
        "deployment's env, as a reference)",
    )
    engine_config: dict[str, Any] | None = Field(
        default=None,
        description="the engine's config file for this role, as a mapping (TensorRT-LLM's "
        "LLM-API YAML); the launcher writes it and passes its path",
    )

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        return checked_args(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return checked_plain_env(v)

    @field_validator("engine_config")
    @classmethod
    def _engine_config(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if not role_engines.json_safe(v):
            raise problem(
                "engine_config",
                "holds something other than strings, numbers, booleans, lists and mappings "
                "with string keys (or nests deeper than 16)",
                "write it as plain YAML",
            )
        if len(json.dumps(v)) > MAX_ENGINE_CONFIG_CHARS:
            raise problem(
                "engine_config",
                f"is larger than {MAX_ENGINE_CONFIG_CHARS // 1024} KiB",
                "keep the engine's own config small",
            )
        return v


class RolesSpec(StrictModel):
    """A deployment's roles: `prefill` and `decode` (disaggregated), or `agg` alone."""

    prefill: RoleSpec | None = Field(
        default=None, description="workers that run the prompt and hand its KV cache over"
    )
    decode: RoleSpec | None = Field(
        default=None, description="workers that receive the KV cache and generate the answer"
    )
    agg: RoleSpec | None = Field(
        default=None,
        description="aggregated workers in the engine's own sizes (a recipe's agg role): "
        "prefill and decode in one process",
    )

    @model_validator(mode="after")
    def _which(self) -> RolesSpec:
        pd = (self.prefill is not None, self.decode is not None)
        if self.agg is not None and any(pd):
            raise problem(
                "agg",
                "an aggregated role beside prefill or decode",
                "give either prefill and decode (disaggregated) or agg alone",
            )
        if self.agg is None and pd != (True, True):
            missing = "decode" if pd[0] else "prefill"
            raise problem(
                missing,
                "is missing: a disaggregated deployment needs both prefill and decode",
                f"add roles.{missing}, or use roles.agg for an aggregated deployment",
            )
        return self

    def items(self) -> list[tuple[str, RoleSpec]]:
        """The roles this deployment has, in launch order (prefill, decode; or agg)."""
        named = {"prefill": self.prefill, "decode": self.decode, "agg": self.agg}
        return [(name, role) for name, role in named.items() if role is not None]

    @property
    def disaggregated(self) -> bool:
        return self.agg is None


def _sizes(role: RoleSpec) -> str:
    words = [f"tensor_parallel {role.tensor_parallel}"]
    if role.pipeline_parallel > 1:
        words.append(f"pipeline_parallel {role.pipeline_parallel}")
    if role.data_parallel > 1:
        attention = " (DP attention)" if role.dp_attention else ""
        words.append(f"data_parallel {role.data_parallel}{attention}")
    return ", ".join(words)


def check_roles_shape(
    engine: str,
    command: list[str],
    kv_transfer: str | None,
    roles: RolesSpec,
    fields_set: set[str],
) -> None:
    """Refuse what engine `engine` cannot run of a deployment's roles, or classic shape
    fields (`fields_set`: the ones the deployment sets) beside them."""
    support = engines.profile(engine).roles
    if support is None:
        raise problem(
            "roles",
            f"engine {engine} has no role launch (prefill, decode or agg workers)",
            "use the classic shape fields (tensor_parallel, replicas, …), or an engine "
            "with roles: " + ", ".join(n for n, p in engines.PROFILES.items() if p.roles),
        )
    for name in CLASSIC_SHAPE_FIELDS:
        if name in fields_set:
            raise problem(
                name,
                "describes the classic replica shape, but the deployment has roles",
                f"remove {name}: each role sets its own sizes (roles.<role>.tensor_parallel, "
                "workers, …)",
            )
    for i, arg in enumerate(command):
        if arg.split("=", 1)[0] in support.launcher_flags:
            flag = arg.split("=", 1)[0]
            raise problem(
                "command",
                f"{flag} (argument {i}) is set by the launcher for each role",
                f"remove {flag} from the command",
            )
    if kv_transfer is not None and not roles.disaggregated:
        raise problem(
            "kv_transfer",
            "is for a disaggregated deployment, but the roles are aggregated (agg)",
            "remove kv_transfer",
        )
    if kv_transfer is not None and kv_transfer not in support.transfer_backends:
        raise problem(
            "kv_transfer",
            f"{kv_transfer!r} is not a transfer backend engine {engine} knows",
            "use one of " + ", ".join(support.transfer_backends),
        )
    for name, role in roles.items():
        where = f"roles.{name}"
        for field, message, fix in support.problems(engine, where, role):
            raise problem(field, message, fix)
        if kv_transfer is not None and any(
            a.split("=", 1)[0] == "--kv-transfer-config" for a in role.args
        ):
            raise problem(
                f"{where}.args",
                "--kv-transfer-config is set in the role's args and kv_transfer is set too",
                "keep one: the role's own connector config, or kv_transfer",
            )
        if role.engine_config is not None and not support.engine_config:
            raise problem(
                f"{where}.engine_config",
                f"engine {engine} takes its settings as flags, not a config file",
                "write them as args",
            )
        need = support.worker_gpus(role)
        if role.gpus_per_worker is not None and role.gpus_per_worker != need:
            raise problem(
                f"{where}.gpus_per_worker",
                f"{role.gpus_per_worker} GPUs, but its sizes need {need} on engine "
                f"{engine} ({_sizes(role)})",
                f"set gpus_per_worker: {need}, or change the sizes",
            )


def role_placement_problems(engine: str, roles: RolesSpec, node_gpus: int) -> list[Problem]:
    """What nodes of `node_gpus` GPUs cannot hold of a deployment's roles: (field, message, fix)."""
    from slurmgate.runtime.engines.layout import RolePlacementError, role_placement

    found: list[Problem] = []
    for name, role in roles.items():
        try:
            placed = role_placement(role_worker_gpus(engine, roles, name), node_gpus, role)
        except RolePlacementError as exc:
            found.append((f"roles.{name}.{exc.field}", exc.message, exc.fix))
            continue
        support = engines.profile(engine).roles
        if placed.nodes_per_worker > 1 and support is not None and not support.multi_node:
            found.append(
                (
                    f"roles.{name}",
                    f"a worker of {role_worker_gpus(engine, roles, name)} GPUs spans "
                    f"{placed.nodes_per_worker} nodes, and engine {engine} launches a "
                    "worker on one node only here",
                    "use workers of at most one node's GPUs",
                )
            )
    return found


def role_worker_gpus(engine: str, roles: RolesSpec, role: str) -> int:
    """GPUs one worker of `role` takes (the engine's rule, or gpus_per_worker)."""
    spec = dict(roles.items())[role]
    support = engines.profile(engine).roles
    assert support is not None
    return spec.gpus_per_worker or support.worker_gpus(spec)
