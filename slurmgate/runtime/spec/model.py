"""The allocation spec: a strict, versioned description of the client and the model deployments."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from slurmgate.errors import InputError
from slurmgate.runtime.endpoint.config import TOKEN_ENV
from slurmgate.runtime.engines import frontends
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.engines import roles as role_engines
from slurmgate.runtime.engines.layout import port_problems
from slurmgate.runtime.redact import CREDENTIAL_FLAG, CREDENTIAL_NAME, literal_credential

# Flags the launcher owns, per engine: a command that sets them itself would fight the layout.
LAUNCHER_FLAGS: dict[str, tuple[str, ...]] = {
    name: p.launcher_flags for name, p in engines.PROFILES.items()
}
# Environment names the runtime owns for every lane.
RESERVED_ENV_PREFIXES = ("SLURM_", "SLURMGATE_RUN_")
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", TOKEN_ENV)
# Names whose values are credentials: a plain value would be stored in Prefect as a flow-run
# parameter, so the spec must reference it instead.
SECRET_NAME = CREDENTIAL_NAME
_REFERENCE_FIX = "{secret: BLOCK-NAME} or {from_env: NAME}"

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
_TIME_LIMIT = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$")
# Slurm names of partitions, accounts and QOSes (a partition may be a comma list): no spaces,
# nothing that could read as another option.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}(,[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})*$")
# A Slurm constraint: features joined by & | , with brackets, counts (*N) and parentheses.
_SLURM_CONSTRAINT = re.compile(r"^[A-Za-z0-9_(\[][A-Za-z0-9_.&|,*()\[\]:-]{0,199}$")


class SpecError(InputError):
    """A spec problem, worded as `field: message — fix`."""

    def __init__(self, problems: list[tuple[str, str, str]]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"{f}: {m} — {fix}" for f, m, fix in problems))


_PROBLEM = re.compile(
    r"^(?:Value error, )?(?P<field>[\w\[\].]+): (?P<msg>.*) — fix: (?P<fix>.*)$", re.S
)


def _problem(field: str, message: str, fix: str) -> ValueError:
    # Readable as it stands (Prefect shows pydantic's message for bad flow parameters), and
    # parseable back into its parts for SpecError.
    return ValueError(f"{field}: {message} — fix: {fix}")


def _checked_name(v: str, what: str) -> str:
    if not _NAME.match(v):
        raise _problem(
            "name",
            f"{v!r} is not a valid {what} name",
            "use lowercase letters, digits and dashes, starting with a letter (≤ 40)",
        )
    return v


def _named(what: str) -> AfterValidator:
    return AfterValidator(lambda v: _checked_name(v, what))


DeploymentName = Annotated[str, _named("deployment")]
AllocationName = Annotated[str, _named("allocation")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SecretBlockRef(_Strict):
    """A Prefect Secret block, by name, read on the client host when the run starts."""

    secret: str = Field(min_length=1, description="name of a Prefect Secret block")


class EnvSecretRef(_Strict):
    """A variable of the controller's own environment, read on the client host."""

    from_env: str = Field(min_length=1, description="name of the controller's variable")


# A credential in the spec: only its reference is ever stored (a SecretStr shows as ****).
SecretValue = SecretBlockRef | EnvSecretRef | SecretStr
EnvValue = str | SecretValue


def _checked_env(v: dict[str, EnvValue], *, lanes: bool) -> dict[str, EnvValue]:
    for key, value in v.items():
        reserved = key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES)
        if (reserved and lanes) or key == TOKEN_ENV:
            raise _problem("env", f"{key} is set by the runtime", f"remove {key}")
        if isinstance(value, str) and SECRET_NAME.search(key):
            raise _problem(
                "env",
                f"{key} looks like a credential and its value would be stored in Prefect",
                f"reference it: {key}: {{secret: BLOCK-NAME}} or {key}: {{from_env: NAME}}",
            )
        kind = literal_credential(value) if isinstance(value, str) else None
        if kind is not None:
            raise _problem(
                "env",
                f"the value of {key} holds {kind}, which would be stored in Prefect",
                f"give the credential its own variable as {_REFERENCE_FIX} and refer to it",
            )
    return v


def describe_secret(value: SecretValue) -> str:
    """A reference as words, safe to log: never the value."""
    if isinstance(value, SecretBlockRef):
        return f"Secret block {value.secret!r}"
    if isinstance(value, EnvSecretRef):
        return f"controller variable {value.from_env}"
    return "a SecretStr value"


class BackpressureSpec(_Strict):
    """Per-lane queue limit the logical endpoint enforces."""

    max_waiting_requests: int = Field(default=128, ge=0)
    retry_after_s: int = Field(default=1, ge=0, description="0 omits the Retry-After header")


class ClientSpec(_Strict):
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
        found = _credential_flag(v)
        if found is not None:
            raise _problem(
                "command",
                f"{found} carries a credential, which would be stored in Prefect with the spec "
                "and shown in the client host's process list",
                f"give it to the client's env as {_REFERENCE_FIX} and use $NAME in a script; "
                "the endpoint's token is in $SLURMGATE_ENDPOINT_TOKEN",
            )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, EnvValue]) -> dict[str, EnvValue]:
        return _checked_env(v, lanes=False)


MAX_ROLE_WORKERS = 512
MAX_ROLE_ARGS = 512
MAX_ROLE_ARG_CHARS = 16384
MAX_ENGINE_CONFIG_CHARS = 256 * 1024
ROLE_NAMES = role_engines.ROLE_NAMES


def _credential_flag(argv: list[str]) -> str | None:
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


class RoleSpec(_Strict):
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
        for i, arg in enumerate(v):
            if len(arg) > MAX_ROLE_ARG_CHARS or "\0" in arg:
                raise _problem(
                    "args",
                    f"argument {i} is longer than {MAX_ROLE_ARG_CHARS} characters or holds a "
                    "NUL byte",
                    "shorten it (a large engine config goes in engine_config)",
                )
        flag = _credential_flag(v)
        if flag is not None:
            raise _problem(
                "args",
                f"{flag} carries a credential, which would be stored in Prefect with the spec "
                "and shown in every node's process list",
                f"remove {flag} and its value: give it to the deployment's env as "
                "{secret: BLOCK} or {from_env: NAME}",
            )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _ENV_NAME.match(key):
                raise _problem(
                    "env", f"{key!r} is not a variable name", "use letters, digits and _"
                )
            if SECRET_NAME.search(key):
                raise _problem(
                    "env",
                    f"{key} looks like a credential, and a role's env holds plain values only",
                    f"move {key} to the deployment's env as {{secret: BLOCK-NAME}} or "
                    "{from_env: NAME}",
                )
        _checked_env(dict(v), lanes=True)
        return v

    @field_validator("engine_config")
    @classmethod
    def _engine_config(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if not role_engines.json_safe(v):
            raise _problem(
                "engine_config",
                "holds something other than strings, numbers, booleans, lists and mappings "
                "with string keys (or nests deeper than 16)",
                "write it as plain YAML",
            )
        if len(json.dumps(v)) > MAX_ENGINE_CONFIG_CHARS:
            raise _problem(
                "engine_config",
                f"is larger than {MAX_ENGINE_CONFIG_CHARS // 1024} KiB",
                "keep the engine's own config small",
            )
        return v


class RolesSpec(_Strict):
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
            raise _problem(
                "agg",
                "an aggregated role beside prefill or decode",
                "give either prefill and decode (disaggregated) or agg alone",
            )
        if self.agg is None and pd != (True, True):
            missing = "decode" if pd[0] else "prefill"
            raise _problem(
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


def _port(default: int, description: str) -> Any:
    return Field(default=default, ge=1024, le=65535, description=description)


class FrontendSpec(_Strict):
    """The field's own router or frontend, started on the client node in front of the workers."""

    type: frontends.FrontendName = Field(
        description="dynamo (with the etcd and NATS it needs), sglang-router, vllm-router, or "
        "trtllm-serve (disaggregated); the logical endpoint then routes to it"
    )
    command: list[str] | None = Field(
        default=None,
        min_length=1,
        description="its argv before the launcher's flags; default: the type's own (python3 -m "
        "dynamo.frontend, python3 -m sglang_router.launch_router, vllm-router, trtllm-serve "
        "disaggregated)",
    )
    args: list[str] = Field(
        default_factory=list, max_length=MAX_ROLE_ARGS, description="its own flags, last"
    )
    env: dict[str, str] = Field(default_factory=dict, description="its own env, plain values")
    port: int = _port(8000, "its HTTP port on the client node")
    request_plane: frontends.RequestPlane = Field(
        default="tcp", description="Dynamo's request plane between frontend and workers"
    )
    etcd_port: int = _port(2379, "Dynamo: etcd's client port on the client node (+1: peers)")
    nats_port: int = _port(4222, "Dynamo: NATS's port on the client node")
    nats_monitor_port: int = _port(8222, "Dynamo: NATS's monitoring port (readiness)")
    etcd_command: list[str] = Field(
        default_factory=lambda: ["etcd"], min_length=1, description="Dynamo: etcd's binary"
    )
    nats_command: list[str] = Field(
        default_factory=lambda: ["nats-server"],
        min_length=1,
        description="Dynamo: the NATS server's binary",
    )
    startup_timeout_s: float = Field(
        default=600.0, gt=0, description="seconds it has to list every worker once they are up"
    )

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        return RoleSpec._args(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return RoleSpec._env(v)

    @property
    def profile(self) -> frontends.FrontendProfile:
        return frontends.FRONTENDS[self.type]

    @property
    def argv_head(self) -> list[str]:
        """Its command: the spec's, or the type's own."""
        return list(self.command or self.profile.command)

    @property
    def service_ports(self) -> dict[str, int]:
        return {
            "etcd": self.etcd_port,
            "etcd_peer": self.etcd_port + 1,
            "nats": self.nats_port,
            "nats_monitor": self.nats_monitor_port,
        }


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


class DeploymentSpec(_Strict):
    """One model deployment: replicas of TP×PP (or DP×TP) lanes, placed on whole nodes."""

    name: DeploymentName = Field(
        description="lowercase letters, digits and dashes; names the endpoint "
        "(SLURMGATE_ENDPOINT_<NAME>), the steps and the logs"
    )
    engine: engines.EngineName = Field(
        default="custom",
        description="the model server: vllm, sglang or llamacpp use that engine's readiness "
        "probes, queue metric and launch flags; custom is a server with vLLM's flags and "
        "metric names whose /v1/models answers 200 (the stub server)",
    )
    command: list[str] = Field(
        min_length=1,
        description="the server's argv; the launcher appends the engine's layout flags (a "
        "command that sets one of them is refused), and an absolute model path in it is "
        "checked on every node; a credential flag with a value (--api-key K) is refused: "
        "give the credential in env",
    )
    tensor_parallel: int = Field(
        default=1, ge=1, description="GPUs of one replica on each of its nodes"
    )
    pipeline_parallel: int = Field(
        default=1, ge=1, description="pipeline stages of one replica, one per node"
    )
    data_parallel: int = Field(
        default=1,
        ge=1,
        description="data-parallel ranks of one replica's server, each of tensor_parallel GPUs, "
        "spread evenly over nodes_per_replica nodes (engine vllm; pipeline_parallel 1)",
    )
    replicas: int = Field(default=1, ge=1, description="independent copies behind the endpoint")
    nodes_per_replica: int = Field(
        default=1,
        ge=1,
        description="nodes one replica spans: pipeline_parallel, or the nodes its "
        "data-parallel ranks are spread over",
    )
    lanes_per_node: int | None = Field(
        default=None, ge=1, description="replicas sharing a node group; default fills the GPUs"
    )
    gpus_per_node: int | None = Field(
        default=None, ge=0, description="GPUs this deployment uses per node (≤ the node's)"
    )
    base_port: int = Field(
        default=18000, ge=1024, le=65535, description="HTTP port of lane 0's head; lane L: +L"
    )
    rendezvous_base_port: int = Field(
        default=19000,
        ge=1024,
        le=65535,
        description="a multi-node replica's rendezvous port on its head node (lane 0; the "
        "next lanes follow, spaced by what the engine opens there)",
    )
    endpoint_port: int = Field(
        default=17000,
        ge=1024,
        le=65535,
        description="the logical endpoint's port on the client node",
    )
    startup_timeout_s: float = Field(
        default=900.0, gt=0, description="seconds a lane has to become ready, after its delay"
    )
    distributed_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="the engine's rendezvous timeout across a replica's nodes "
        "(≤ startup_timeout_s)",
    )
    probe_timeout_s: float = Field(default=1.0, gt=0, description="timeout of one readiness GET")
    ready_probes: int = Field(
        default=2, ge=1, le=100, description="good readiness probes in a row before a lane is ready"
    )
    readiness_path: str = Field(
        default="/health",
        description="the health path a lane answers 200 on once it can serve (each engine's "
        "profile adds its own /v1/models check); the endpoint probes it too",
    )
    enable_expert_parallel: bool = Field(
        default=False,
        description="shard the MoE experts over the replica's GPUs (vLLM "
        "--enable-expert-parallel: expert-parallel size = data_parallel × tensor_parallel); "
        "across nodes only with data_parallel",
    )
    lead_boot_standoff_s: float = Field(
        default=60.0, ge=0, description="seconds replica 0 boots alone before replica 1 starts"
    )
    rank_launch_stagger_s: float = Field(
        default=5.0, ge=0, description="then replica i starts i × this later"
    )
    roles: RolesSpec | None = Field(
        default=None,
        description="prefill and decode workers (disaggregated), or agg workers, each role in "
        "the engine's own sizes; the classic shape fields above then stay unset",
    )
    kv_transfer: str | None = Field(
        default=None,
        description="how prefill hands the KV cache to decode: SGLang's "
        "--disaggregation-transfer-backend (mooncake, nixl, …), vLLM's connector (nixl: "
        "NixlConnector kv_both, the default), TensorRT-LLM's cache transceiver backend",
    )
    bootstrap_base_port: int = Field(
        default=18500,
        ge=1024,
        le=65535,
        description="a prefill worker's bootstrap port on its head node (lane slot L: +L), "
        "where decode workers fetch its KV cache handshake (SGLang)",
    )
    frontend: FrontendSpec | None = Field(
        default=None,
        description="the field's own router or frontend on the client node (Dynamo's, "
        "sglang-router, vllm-router, trtllm-serve); unset: the logical endpoint routes to the "
        "workers itself",
    )
    side_base_port: int = Field(
        default=20000,
        ge=1024,
        le=65535,
        description="ports a role process opens besides HTTP (SGLang's NCCL port, vLLM's NIXL "
        "side channel, Dynamo's status server), from here in blocks per lane slot",
    )
    backpressure: BackpressureSpec = Field(
        default_factory=BackpressureSpec,
        description="the endpoint's per-lane queue limit, read from the engine's queue metric",
    )
    env: dict[str, EnvValue] = Field(
        default_factory=dict,
        description="this deployment's lanes only: plain values or secret references",
    )

    @field_validator("readiness_path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or any(c in v for c in "?# \t"):
            raise _problem("readiness_path", f"{v!r} is not an absolute path", "use e.g. /health")
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str], info: ValidationInfo) -> list[str]:
        engine = info.data.get("engine")
        if engine is None:  # the engine itself was refused: that error says enough
            return v
        for arg in v:
            flag = engines.profile(engine).owned_flag(arg)
            if flag is not None:
                raise _problem(
                    "command",
                    f"{flag} is set by the launcher from the layout (engine {engine})",
                    f"remove {flag} from the command",
                )
        name = _credential_flag(v)
        if name is not None:
            raise _problem(
                "command",
                f"{name} carries a credential, which would be stored in Prefect with the "
                "spec and shown in every node's process list",
                f"remove {name} and its value: give the server the credential in env as "
                "{secret: BLOCK} or {from_env: NAME} (vLLM reads VLLM_API_KEY, llama.cpp "
                "LLAMA_API_KEY, Hugging Face HF_TOKEN); clients authenticate at the "
                "endpoint with endpoint_token",
            )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, EnvValue]) -> dict[str, EnvValue]:
        return _checked_env(v, lanes=True)

    @model_validator(mode="after")
    def _topology(self) -> DeploymentSpec:
        self._frontend_pairing()
        if self.roles is not None:
            self._roles_shape(self.roles)
            return self
        if self.kv_transfer is not None:
            raise _problem(
                "kv_transfer",
                "is for a deployment with prefill and decode roles",
                "remove kv_transfer, or add roles.prefill and roles.decode",
            )
        for field, message, fix in engines.profile(self.engine).problems(self):
            raise _problem(field, message, fix)
        if self.data_parallel > 1:
            self._data_parallel_shape()
        elif self.pipeline_parallel != self.nodes_per_replica:
            raise _problem(
                "pipeline_parallel",
                f"pipeline_parallel={self.pipeline_parallel} but nodes_per_replica="
                f"{self.nodes_per_replica}; each pipeline stage runs on its own node",
                "set nodes_per_replica equal to pipeline_parallel",
            )
        if self.enable_expert_parallel and self.nodes_per_replica > 1 and self.data_parallel == 1:
            raise _problem(
                "enable_expert_parallel",
                "expert parallel across nodes is only for a data-parallel replica (the seed "
                "refuses it too): a pipeline-parallel replica's experts would span its stages",
                "use nodes_per_replica: 1, spread data_parallel ranks over the nodes instead, "
                "or turn enable_expert_parallel off",
            )
        if self.enable_expert_parallel and self.tensor_parallel * self.data_parallel == 1:
            raise _problem(
                "enable_expert_parallel",
                "with tensor_parallel=1 and data_parallel=1 the expert-parallel group is one "
                "GPU, which holds every expert: the flag would change nothing",
                "raise tensor_parallel or data_parallel, or turn enable_expert_parallel off",
            )
        if self.distributed_timeout_s > self.startup_timeout_s:
            raise _problem(
                "distributed_timeout_s",
                "the rendezvous timeout exceeds startup_timeout_s",
                "lower distributed_timeout_s or raise startup_timeout_s",
            )
        return self

    def _frontend_pairing(self) -> None:
        needed = engines.profile(self.engine).frontend
        if self.frontend is None:
            if needed is not None:
                raise _problem(
                    "frontend",
                    f"engine {self.engine}'s workers serve no client HTTP: they need the "
                    f"{needed} frontend",
                    f"add frontend: {{type: {needed}}}",
                )
            return
        profile = self.frontend.profile
        if self.engine not in profile.engines:
            raise _problem(
                "frontend.type",
                f"{self.frontend.type} does not front engine {self.engine}",
                "use it with engine " + " or ".join(profile.engines),
            )
        if self.roles is None:
            raise _problem(
                "frontend",
                "a frontend fronts a deployment's role workers",
                "give roles (prefill and decode, or agg), or remove frontend",
            )
        if profile.pd_only and not self.roles.disaggregated:
            raise _problem(
                "frontend.type",
                f"{self.frontend.type} fronts prefill and decode workers only",
                "give roles.prefill and roles.decode, or remove frontend",
            )

    @property
    def request_plane(self) -> str:
        """Dynamo's request plane (its workers' `--request-plane`)."""
        return self.frontend.request_plane if self.frontend else "tcp"

    def _roles_shape(self, roles: RolesSpec) -> None:
        support = engines.profile(self.engine).roles
        if support is None:
            raise _problem(
                "roles",
                f"engine {self.engine} has no role launch (prefill, decode or agg workers)",
                "use the classic shape fields (tensor_parallel, replicas, …), or an engine "
                "with roles: " + ", ".join(n for n, p in engines.PROFILES.items() if p.roles),
            )
        for name in CLASSIC_SHAPE_FIELDS:
            if name in self.model_fields_set:
                raise _problem(
                    name,
                    "describes the classic replica shape, but the deployment has roles",
                    f"remove {name}: each role sets its own sizes (roles.<role>.tensor_parallel, "
                    "workers, …)",
                )
        for i, arg in enumerate(self.command):
            if arg.split("=", 1)[0] in support.launcher_flags:
                flag = arg.split("=", 1)[0]
                raise _problem(
                    "command",
                    f"{flag} (argument {i}) is set by the launcher for each role",
                    f"remove {flag} from the command",
                )
        if self.kv_transfer is not None and not roles.disaggregated:
            raise _problem(
                "kv_transfer",
                "is for a disaggregated deployment, but the roles are aggregated (agg)",
                "remove kv_transfer",
            )
        if self.kv_transfer is not None and self.kv_transfer not in support.transfer_backends:
            raise _problem(
                "kv_transfer",
                f"{self.kv_transfer!r} is not a transfer backend engine {self.engine} knows",
                "use one of " + ", ".join(support.transfer_backends),
            )
        for name, role in roles.items():
            where = f"roles.{name}"
            for field, message, fix in support.problems(self.engine, where, role):
                raise _problem(field, message, fix)
            if self.kv_transfer is not None and any(
                a.split("=", 1)[0] == "--kv-transfer-config" for a in role.args
            ):
                raise _problem(
                    f"{where}.args",
                    "--kv-transfer-config is set in the role's args and kv_transfer is set too",
                    "keep one: the role's own connector config, or kv_transfer",
                )
            if role.engine_config is not None and not support.engine_config:
                raise _problem(
                    f"{where}.engine_config",
                    f"engine {self.engine} takes its settings as flags, not a config file",
                    "write them as args",
                )
            need = support.worker_gpus(role)
            if role.gpus_per_worker is not None and role.gpus_per_worker != need:
                raise _problem(
                    f"{where}.gpus_per_worker",
                    f"{role.gpus_per_worker} GPUs, but its sizes need {need} on engine "
                    f"{self.engine} ({_sizes(role)})",
                    f"set gpus_per_worker: {need}, or change the sizes",
                )

    def role_problems(self, node_gpus: int) -> list[tuple[str, str, str]]:
        """What the nodes cannot hold of this deployment's roles: (field, message, fix)."""
        from slurmgate.runtime.engines.layout import RolePlacementError, role_placement

        found: list[tuple[str, str, str]] = []
        for name, role in self.roles.items() if self.roles else []:
            try:
                placed = role_placement(self.worker_gpus(name), node_gpus, role)
            except RolePlacementError as exc:
                found.append((f"roles.{name}.{exc.field}", exc.message, exc.fix))
                continue
            support = engines.profile(self.engine).roles
            if placed.nodes_per_worker > 1 and support is not None and not support.multi_node:
                found.append(
                    (
                        f"roles.{name}",
                        f"a worker of {self.worker_gpus(name)} GPUs spans "
                        f"{placed.nodes_per_worker} nodes, and engine {self.engine} launches a "
                        "worker on one node only here",
                        "use workers of at most one node's GPUs",
                    )
                )
        return found

    def worker_gpus(self, role: str) -> int:
        """GPUs one worker of `role` takes (the engine's rule, or gpus_per_worker)."""
        assert self.roles is not None
        spec = dict(self.roles.items())[role]
        support = engines.profile(self.engine).roles
        assert support is not None
        return spec.gpus_per_worker or support.worker_gpus(spec)

    def _data_parallel_shape(self) -> None:
        if self.pipeline_parallel != 1:
            raise _problem(
                "pipeline_parallel",
                f"pipeline_parallel={self.pipeline_parallel} with data_parallel="
                f"{self.data_parallel}: a data-parallel replica has one pipeline stage",
                "set pipeline_parallel: 1, or data_parallel: 1",
            )
        if self.data_parallel % self.nodes_per_replica:
            raise _problem(
                "data_parallel",
                f"data_parallel={self.data_parallel} ranks do not spread evenly over "
                f"nodes_per_replica={self.nodes_per_replica} nodes",
                "make data_parallel a multiple of nodes_per_replica",
            )

    @property
    def gpus_per_lane(self) -> int:
        """GPUs one lane (a replica's process on one of its nodes) runs on: its node's share
        of the data-parallel ranks, each of tensor_parallel GPUs (a pipeline stage is one)."""
        if self.data_parallel == 1:
            return self.tensor_parallel
        return self.tensor_parallel * (self.data_parallel // self.nodes_per_replica)

    def used_gpus_per_node(self, node_gpus: int) -> int:
        """GPUs this deployment's node worker plans per node."""
        return self.gpus_per_node if self.gpus_per_node is not None else node_gpus

    def lanes_for(self, node_gpus: int) -> int:
        """Lanes (replicas) per node group: explicit, or as many as the GPUs hold."""
        if self.lanes_per_node is not None:
            return min(self.lanes_per_node, self.replicas)
        fit = self.used_gpus_per_node(node_gpus) // self.gpus_per_lane
        return max(1, min(self.replicas, fit))

    def nodes_for(self, node_gpus: int) -> int:
        if self.roles is not None:
            from slurmgate.runtime.engines.layout import role_placement

            return sum(
                role_placement(self.worker_gpus(name), node_gpus, role).nodes
                for name, role in self.roles.items()
            )
        groups = -(-self.replicas // self.lanes_for(node_gpus))
        return groups * self.nodes_per_replica


def _sizes(role: RoleSpec) -> str:
    words = [f"tensor_parallel {role.tensor_parallel}"]
    if role.pipeline_parallel > 1:
        words.append(f"pipeline_parallel {role.pipeline_parallel}")
    if role.data_parallel > 1:
        attention = " (DP attention)" if role.dp_attention else ""
        words.append(f"data_parallel {role.data_parallel}{attention}")
    return ", ".join(words)


def _slurm_name(field: str, v: str | None, example: str) -> str | None:
    if v is not None and not _SLURM_NAME.match(v):
        raise _problem(
            field,
            f"{v!r} is not a Slurm {field} name",
            f"use the name `sinfo`/`sacctmgr` shows, e.g. {example}",
        )
    return v


class SlurmSpec(_Strict):
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
            raise _problem(
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


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


MAX_HOOK_COMMANDS = 32
MAX_HOOK_COMMAND_CHARS = 4096
MAX_HOOK_TIMEOUT_S = 86400.0


class HookSpec(_Strict):
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
            raise _problem("commands", "is empty", "give at least one shell command")
        if len(v) > MAX_HOOK_COMMANDS:
            raise _problem(
                "commands",
                f"{len(v)} commands, more than {MAX_HOOK_COMMANDS}",
                "put them in a script on the host and call it",
            )
        for i, command in enumerate(v):
            if not command.strip():
                raise _problem("commands", f"command {i} is empty", "remove it")
            if len(command) > MAX_HOOK_COMMAND_CHARS:
                raise _problem(
                    "commands",
                    f"command {i} is longer than {MAX_HOOK_COMMAND_CHARS} characters",
                    "put it in a script on the host and call it",
                )
            if "\0" in command:
                raise _problem("commands", f"command {i} contains a NUL byte", "remove it")
            kind = literal_credential(command)
            if kind is not None:
                raise _problem(
                    "commands",
                    f"command {i} holds {kind}, which would be stored in Prefect with the spec",
                    f"give it to the hook's env as NAME: {_REFERENCE_FIX} and use $NAME in the "
                    "command",
                )
        return v

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not 0 < v <= MAX_HOOK_TIMEOUT_S:
            raise _problem(
                "timeout_s",
                f"{v:g} is not a time limit in seconds",
                f"give seconds above 0, at most {MAX_HOOK_TIMEOUT_S:g} (a day)",
            )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, EnvValue]) -> dict[str, EnvValue]:
        for key in v:
            if not _ENV_NAME.match(key):
                raise _problem(
                    "env", f"{key!r} is not a variable name", "use letters, digits and _"
                )
            if key.startswith("SLURMGATE_") or key == "SLURM_JOB_ID":
                raise _problem("env", f"{key} is set by the runtime", f"remove {key}")
        return _checked_env(v, lanes=False)


class HooksSpec(_Strict):
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
            raise _problem(
                str(info.field_name),
                "is not a mapping",
                f"write it as {info.field_name}: {{commands: [COMMAND, ...], timeout_s: 600}}",
            )
        return v

    def named(self) -> dict[str, HookSpec]:
        """The hooks the spec sets, by name."""
        hooks = {"prolog": self.prolog, "epilog": self.epilog}
        return {name: hook for name, hook in hooks.items() if hook is not None}


class AllocationSpec(_Strict):
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
            raise _problem("time_limit", f"{v!r} is not a Slurm time", "use [D-]HH:MM:SS")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or any(c.isspace() for c in v)):
            raise _problem(
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
                raise _problem(
                    f"deployments[{i}].name", f"{d.name!r} is used twice", "give each a name"
                )
            if d.roles is not None:
                for f, m, fix in d.role_problems(self.gpus_per_node):
                    raise _problem(f"deployments[{i}].{f}", m, fix)
                continue
            used = d.used_gpus_per_node(self.gpus_per_node)
            if used > self.gpus_per_node:
                raise _problem(
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
                raise _problem(
                    f"deployments[{i}].lanes_per_node",
                    f"{lanes} lanes × {per_lane} = {need} GPUs, "
                    f"but the deployment has {used} per node: a GPU would be shared by two lanes",
                    "lower lanes_per_node, tensor_parallel or data_parallel, or raise "
                    "gpus_per_node",
                )
        # Port collisions are a layout question: the same plan the runtime uses decides them.
        problems = port_problems(self)
        if problems:
            f, m, fix = problems[0]
            raise _problem(f, m, fix)
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
        import yaml

        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text())
        except OSError as exc:
            raise SpecError([(str(p), f"cannot read: {exc.strerror}", "check the path")]) from None
        except yaml.YAMLError as exc:
            raise SpecError([(str(p), f"not valid YAML: {exc}", "fix the YAML syntax")]) from None
        return cls.from_data(data, source=str(p))


def spec_error_from(exc: ValidationError, source: str = "spec") -> SpecError:
    """Turn a pydantic ValidationError into a SpecError naming each field and its fix."""
    problems: list[tuple[str, str, str]] = []
    for err in exc.errors():
        loc = _loc(err.get("loc", ()))
        msg = str(err.get("msg", ""))
        m = _PROBLEM.match(msg) if err.get("type") == "value_error" else None
        if m:
            field, message, fix = m.group("field"), m.group("msg"), m.group("fix")
            where = f"{loc}.{field}" if loc and field != loc.rsplit(".", 1)[-1] else loc or field
            if field.startswith("deployments["):
                where = field
            problems.append((where, message, fix))
        elif err.get("type") == "extra_forbidden":
            problems.append((loc, "unknown key", "remove it or check its spelling"))
        elif err.get("type") == "missing":
            problems.append((loc, "is required", "add it"))
        elif err.get("type") == "literal_error" and loc.endswith("schema_version"):
            problems.append((loc, f"unsupported version {err.get('input')!r}", "use 1"))
        else:
            problems.append((loc or source, msg, "fix the value"))
    return SpecError(problems)


def _loc(loc: tuple[Any, ...] | Any) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out
