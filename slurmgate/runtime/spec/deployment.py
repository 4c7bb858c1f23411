"""One model deployment: its engine, command, shape (replicas or roles), ports and timeouts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, ValidationInfo, field_validator, model_validator

from slurmgate.runtime.endpoint.config import DataPlane
from slurmgate.runtime.engines import mocker, vllm_cpu
from slurmgate.runtime.engines import profiles as engines
from slurmgate.runtime.engines.mocker import SYSTEM_PORT_MAX
from slurmgate.runtime.spec.container import ContainerSpec
from slurmgate.runtime.spec.errors import problem
from slurmgate.runtime.spec.fields import DeploymentName, StrictModel
from slurmgate.runtime.spec.frontend import FrontendSpec, check_frontend_pairing
from slurmgate.runtime.spec.mooncake import MooncakeSpec
from slurmgate.runtime.spec.roles import (
    RolesSpec,
    check_roles_shape,
    role_placement_problems,
    role_worker_gpus,
)
from slurmgate.runtime.spec.secret_refs import EnvValue, checked_env, credential_flag

StandIn = Literal["dynamo-mocker", "vllm-cpu"]
STAND_IN_ENGINES = {"dynamo-mocker": ("dynamo-sglang", "dynamo-vllm"), "vllm-cpu": ("vllm",)}
STAND_IN_FOR = {"dynamo-mocker": "a Dynamo worker", "vllm-cpu": "vLLM's server"}


class BackpressureSpec(StrictModel):
    """Per-lane queue limit the logical endpoint enforces."""

    max_waiting_requests: int = Field(default=128, ge=0)
    retry_after_s: int = Field(default=1, ge=0, description="0 omits the Retry-After header")


CONFIGS_DIR = "/configs/"


class DeploymentSpec(StrictModel):
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
    mpi_launch: list[Annotated[str, StringConstraints(min_length=1, max_length=4096)]] = Field(
        default_factory=lambda: ["trtllm-llmapi-launch"],
        min_length=1,
        max_length=16,
        description="what every rank of a worker over several nodes runs before the server's "
        "argv, on an engine whose such workers are one MPI world (trtllm, dynamo-trtllm: one "
        "`srun --mpi=pmix` step, a task per GPU): TensorRT-LLM's launcher, whose rank 0 runs "
        "the server and whose other ranks serve it",
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
    mooncake: MooncakeSpec | None = Field(
        default=None,
        description="a Mooncake store (srt-slurm's mooncake_kv_store): its master and HTTP "
        "metadata server on the client node before the workers, and every worker told where "
        "they are (MOONCAKE_MASTER, MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_CONFIG_PATH)",
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
    endpoint_data_plane: DataPlane = Field(
        default="python",
        description="who forwards the endpoint's requests: python (the endpoint itself, every "
        "rule) or haproxy (Debian's HAProxy forwards the common request at nginx's CPU cost; "
        "the endpoint decides which lanes take work and answers the rest; a lane's 429 or 5xx "
        "is passed on, not retried). Not for prefill and decode lanes the endpoint pairs",
    )
    env: dict[str, EnvValue] = Field(
        default_factory=dict,
        description="this deployment's lanes only: plain values or secret references",
    )
    container: ContainerSpec | None = Field(
        default=None,
        description="run the deployment's node workers and lanes in a container: pyxis's "
        "`srun --container-image` on sites with pyxis and enroot, or Slurm's own OCI "
        "containers (`srun --container=BUNDLE`); unset: the nodes' own filesystem",
    )
    stand_in: StandIn | None = Field(
        default=None,
        description="run a stand-in engine in the workers' place, the deployment's wiring "
        "unchanged: dynamo-mocker (engine dynamo-sglang or dynamo-vllm) runs Dynamo's mocker, "
        "`command` then being its head (e.g. [python, -m, dynamo.mocker]); its model "
        "directory is the command's --model-path, else a tiny one the run writes in its "
        "directory with the command's Python; it serves the model as the deployment's name "
        "unless the command gives --model-name. vllm-cpu (engine vllm) runs vLLM's server on "
        "CPU, `command` being [python, -m, vllm.entrypoints.openai.api_server, …]; its model "
        "is the command's --model, else a tiny Llama with random weights the run writes in "
        "its directory with the command's Python (the vLLM venv's)",
    )

    @field_validator("readiness_path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or any(c in v for c in "?# \t"):
            raise problem("readiness_path", f"{v!r} is not an absolute path", "use e.g. /health")
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
                raise problem(
                    "command",
                    f"{flag} is set by the launcher from the layout (engine {engine})",
                    f"remove {flag} from the command",
                )
        name = credential_flag(v)
        if name is not None:
            raise problem(
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
        return checked_env(v, lanes=True)

    @model_validator(mode="after")
    def _topology(self) -> DeploymentSpec:
        check_frontend_pairing(self.engine, self.frontend, self.roles)
        paired_here = self.frontend is None and self.roles is not None and self.roles.prefill
        if self.endpoint_data_plane == "haproxy" and paired_here:
            raise problem(
                "endpoint_data_plane",
                "haproxy forwards aggregated deployments only: the endpoint itself pairs this "
                "deployment's prefill and decode lanes",
                "leave endpoint_data_plane at python, or put a frontend before the roles",
            )
        if self.stand_in is not None:
            self._stand_in()
        if self.roles is not None:
            check_roles_shape(
                self.engine, self.command, self.kv_transfer, self.roles, self.model_fields_set
            )
            return self
        if self.kv_transfer is not None:
            raise problem(
                "kv_transfer",
                "is for a deployment with prefill and decode roles",
                "remove kv_transfer, or add roles.prefill and roles.decode",
            )
        for field, message, fix in engines.profile(self.engine).problems(self):
            raise problem(field, message, fix)
        if self.data_parallel > 1:
            self._data_parallel_shape()
        elif self.pipeline_parallel != self.nodes_per_replica:
            raise problem(
                "pipeline_parallel",
                f"pipeline_parallel={self.pipeline_parallel} but nodes_per_replica="
                f"{self.nodes_per_replica}; each pipeline stage runs on its own node",
                "set nodes_per_replica equal to pipeline_parallel",
            )
        if self.enable_expert_parallel and self.nodes_per_replica > 1 and self.data_parallel == 1:
            raise problem(
                "enable_expert_parallel",
                "expert parallel across nodes is only for a data-parallel replica (the seed "
                "refuses it too): a pipeline-parallel replica's experts would span its stages",
                "use nodes_per_replica: 1, spread data_parallel ranks over the nodes instead, "
                "or turn enable_expert_parallel off",
            )
        if self.enable_expert_parallel and self.tensor_parallel * self.data_parallel == 1:
            raise problem(
                "enable_expert_parallel",
                "with tensor_parallel=1 and data_parallel=1 the expert-parallel group is one "
                "GPU, which holds every expert: the flag would change nothing",
                "raise tensor_parallel or data_parallel, or turn enable_expert_parallel off",
            )
        if self.distributed_timeout_s > self.startup_timeout_s:
            raise problem(
                "distributed_timeout_s",
                "the rendezvous timeout exceeds startup_timeout_s",
                "lower distributed_timeout_s or raise startup_timeout_s",
            )
        return self

    def _stand_in(self) -> None:
        assert self.stand_in is not None
        engines_ok = STAND_IN_ENGINES[self.stand_in]
        if self.engine not in engines_ok:
            raise problem(
                "stand_in",
                f"{self.stand_in} stands in for {STAND_IN_FOR[self.stand_in]}, not engine "
                f"{self.engine}",
                f"use engine {' or '.join(engines_ok)}, or remove stand_in",
            )
        if self.stand_in == "vllm-cpu":
            if vllm_cpu.command_model_dir(self.command) is None:
                vllm_cpu.command_python(self.command)  # its InputError names command and fix
            return
        if mocker.command_model_dir(self.command) is None:
            mocker.command_python(self.command)  # its InputError names the command and the fix
        # the mocker's status server port is Dynamo's DYN_SYSTEM_PORT, read as a signed
        # 16-bit number: every lane slot's must stay at or below 32767
        top = self.side_base_port + 64
        if top > SYSTEM_PORT_MAX:
            raise problem(
                "side_base_port",
                f"{self.side_base_port}: the mocker's status ports follow it, and Dynamo "
                f"refuses a status port above {SYSTEM_PORT_MAX}",
                f"set side_base_port to at most {SYSTEM_PORT_MAX - 64} (e.g. 20000)",
            )

    @property
    def config_paths(self) -> list[str]:
        """Every `/configs/...` path in the command, env, and the roles' env and args (a whole
        value, or after `=` in `NAME=/configs/...` or `--flag=/configs/...`): srt-slurm's
        recipes mount their configs directory there, so on the nodes each must exist."""
        values: list[object] = [*self.command, *self.env.values()]
        for _, role in self.roles.items() if self.roles is not None else ():
            values += [*role.env.values(), *role.args]
        found = []
        for value in values:
            text = value.rsplit("=", 1)[-1] if isinstance(value, str) else ""
            if text.startswith(CONFIGS_DIR):
                found.append(text)
        return list(dict.fromkeys(found))

    @property
    def request_plane(self) -> str:
        """Dynamo's request plane (its workers' `--request-plane`)."""
        return self.frontend.request_plane if self.frontend else "tcp"

    def role_problems(self, node_gpus: int) -> list[tuple[str, str, str]]:
        """What the nodes cannot hold of this deployment's roles: (field, message, fix)."""
        if self.roles is None:
            return []
        return role_placement_problems(self.engine, self.roles, node_gpus)

    def worker_gpus(self, role: str) -> int:
        """GPUs one worker of `role` takes (the engine's rule, or gpus_per_worker)."""
        assert self.roles is not None
        return role_worker_gpus(self.engine, self.roles, role)

    def _data_parallel_shape(self) -> None:
        if self.pipeline_parallel != 1:
            raise problem(
                "pipeline_parallel",
                f"pipeline_parallel={self.pipeline_parallel} with data_parallel="
                f"{self.data_parallel}: a data-parallel replica has one pipeline stage",
                "set pipeline_parallel: 1, or data_parallel: 1",
            )
        if self.data_parallel % self.nodes_per_replica:
            raise problem(
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
