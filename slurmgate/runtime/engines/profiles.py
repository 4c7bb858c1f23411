"""Model-server engine profiles: each engine's readiness probes, queue metric and launch flags.

A deployment names its engine (`DeploymentSpec.engine`); the runtime asks the engine's profile
what to append to the spec's command on each lane (`lane_argv`), which flags the command must
leave to the launcher, how to tell a lane is ready, which Prometheus gauges hold its queue for
backpressure, and where the command names a model path that preflight checks on every node.
Pure policy: no I/O, standard library only (node workers and endpoints import the runtime).

`custom` is today's contract (the stub server speaks it): vLLM's flag vocabulary and metric
names, and `readiness_path` then `/v1/models` answering 200.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from slurmgate.runtime.engines import flags
from slurmgate.runtime.engines import roles as role_engines
from slurmgate.runtime.engines.roles import RoleSupport

EngineName = Literal[
    "custom",
    "vllm",
    "sglang",
    "llamacpp",
    "trtllm",
    "dynamo-sglang",
    "dynamo-vllm",
    "dynamo-trtllm",
]
MODELS_PATH = "/v1/models"
# A Prometheus metric name (the exposition format's rule).
METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


class EngineDeployment(Protocol):
    """What a profile reads of a deployment (`spec.DeploymentSpec` is one)."""

    @property
    def command(self) -> Sequence[str]: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def pipeline_parallel(self) -> int: ...
    @property
    def data_parallel(self) -> int: ...
    @property
    def nodes_per_replica(self) -> int: ...
    @property
    def distributed_timeout_s(self) -> float: ...
    @property
    def enable_expert_parallel(self) -> bool: ...


class EngineLane(Protocol):
    """What a profile reads of one lane (`layout.LanePlan` is one)."""

    @property
    def rank(self) -> int: ...
    @property
    def port(self) -> int | None: ...
    @property
    def rendezvous_port(self) -> int | None: ...


@dataclass(frozen=True)
class QueueMetrics:
    """The Prometheus gauges of a lane's queue: requests waiting, and requests running."""

    waiting: str
    running: str


@dataclass(frozen=True)
class Probes:
    """What "ready" means: the health path answers 200, then (when `models`) /v1/models does,
    and (when `lists_model`) its `data` lists the served model: the one the command names
    with a served-name flag, else any model."""

    models: bool
    lists_model: bool
    health_note: str = ""  # what the health path answers before it is 200

    def describe(self, health: str = "`readiness_path` (default /health)") -> str:
        steps = [f"{health} answers 200" + (f" ({self.health_note})" if self.health_note else "")]
        if self.models and self.lists_model:
            steps.append(f"{MODELS_PATH} lists the served model")
        elif self.models:
            steps.append(f"{MODELS_PATH} answers 200")
        return ", then ".join(steps)


Problem = tuple[str, str, str]  # (field, message, fix), as spec.SpecError words them
Render = Callable[[EngineDeployment, EngineLane, str, str], list[str]]


@dataclass(frozen=True)
class EngineProfile:
    """One engine: how the runtime launches, probes and samples it."""

    name: EngineName
    summary: str
    docs: tuple[str, ...]  # where the flags, probes and metric names below come from
    probes: Probes
    queue: QueueMetrics
    launcher_flags: tuple[str, ...]  # flags the launcher sets: a command must not
    render: Render
    model_flags: tuple[str, ...] = ()  # flags whose value is the model (a path or a hub id)
    model_after: str | None = None  # a subcommand whose first operand is the model (`serve`)
    served_name_flags: tuple[str, ...] = ()  # flags naming the model id /v1/models lists
    multi_node: bool = True
    expert_parallel: bool = True
    data_parallel: bool = False  # one server over several data-parallel ranks (`data_parallel`)
    # The variable that tells the engine which address its node advertises to the other ranks
    # (on a multi-NIC node its own guess may be an interface the others cannot reach).
    host_ip_env: str | None = None
    # Consecutive ports a multi-node replica's head uses from its rendezvous port on.
    rendezvous_span: int = 1
    note: str = ""  # for docs/spec.md: what a reader of the spec should know besides the above
    # How the engine runs a deployment's `roles` (prefill/decode workers, or srt-slurm style
    # aggregated workers in its own sizes); None: it has no role launch.
    roles: RoleSupport | None = None
    # Only with `roles` (the engine's workers have no classic TP × PP replica launch here).
    roles_only: bool = False
    # The lanes serve clients over HTTP; False: a frontend does (Dynamo's workers register in
    # etcd and answer its request plane), so lanes are not probed or routed to one by one.
    lane_http: bool = True
    # The frontend (`DeploymentSpec.frontend.type`) this engine's workers need, if any.
    frontend: str | None = None

    def lane_argv(
        self, spec: EngineDeployment, lane: EngineLane, master_addr: str, bind_host: str
    ) -> list[str]:
        """The lane's argv: the spec's command plus the flags the layout decides."""
        return self.render(spec, lane, master_addr, bind_host)

    def lane_env(self, bind_host: str, spec_env: Collection[str] = ()) -> dict[str, str]:
        """What the launcher adds to a lane's environment: the node's address, which the lane
        also binds, unless the spec's own env sets the variable."""
        if self.host_ip_env is None or self.host_ip_env in spec_env:
            return {}
        return {self.host_ip_env: bind_host}

    def problems(self, spec: EngineDeployment) -> list[Problem]:
        """What this engine cannot run of the deployment, as (field, message, fix)."""
        found: list[Problem] = []
        if self.roles_only:
            found.append(
                (
                    "roles",
                    f"engine {self.name} runs its workers in roles only",
                    "give roles.agg (or roles.prefill and roles.decode) with the worker sizes",
                )
            )
        if not self.multi_node and spec.nodes_per_replica > 1:
            found.append(
                (
                    "nodes_per_replica",
                    f"engine {self.name} runs a replica on one node only (it has no "
                    f"multi-node launch), but nodes_per_replica={spec.nodes_per_replica}",
                    "set nodes_per_replica: 1 and pipeline_parallel: 1, and add replicas "
                    "for more throughput",
                )
            )
        if not self.data_parallel and spec.data_parallel > 1:
            found.append(
                (
                    "data_parallel",
                    f"engine {self.name} has no data-parallel launch here, but "
                    f"data_parallel={spec.data_parallel}",
                    "set data_parallel: 1 and add replicas (the endpoint balances them)",
                )
            )
        if not self.expert_parallel and spec.enable_expert_parallel:
            found.append(
                (
                    "enable_expert_parallel",
                    f"engine {self.name} has no expert-parallel flag",
                    "turn enable_expert_parallel off",
                )
            )
        return found

    def models_probe(self, command: Sequence[str]) -> tuple[bool, str | None]:
        """For `readiness.Target`: whether a probe GETs /v1/models, and the model its answer
        must list ("" = any model; None = answering 200 is enough)."""
        if not self.probes.lists_model:
            return self.probes.models, None
        return self.probes.models, self.served_model(command) or ""

    def owned_flag(self, arg: str) -> str | None:
        """The launcher-owned flag `arg` sets (as `--flag` or `--flag=value`), else None."""
        flag = arg.split("=", 1)[0]
        return flag if flag in self.launcher_flags else None

    def served_model(self, command: Sequence[str]) -> str | None:
        """The model id the command asks the server to list, when a served-name flag names it."""
        return _flag_value(command, self.served_name_flags)

    def model_path(self, command: Sequence[str]) -> str | None:
        """The model the command loads when it is an absolute path (a hub id is not a path)."""
        # Every value of the model flags, not the first: in `python -m pkg -m /m.gguf` the
        # first `-m` is the interpreter's (a module name, never an absolute path).
        values: list[str | None] = list(_flag_values(command, self.model_flags))
        if self.model_after is not None:
            values.append(_operand_after(command, self.model_after))
        return next((v for v in values if v is not None and v.startswith("/")), None)


def _flag_values(command: Sequence[str], flags: tuple[str, ...]) -> Iterator[str]:
    for i, arg in enumerate(command):
        name, eq, value = arg.partition("=")
        if name in flags and arg.startswith("--") and eq:
            yield value
        elif arg in flags and i + 1 < len(command):
            yield command[i + 1]


def _flag_value(command: Sequence[str], flags: tuple[str, ...]) -> str | None:
    return next(_flag_values(command, flags), None)


def _operand_after(command: Sequence[str], word: str) -> str | None:
    if word not in command:
        return None
    rest = command[list(command).index(word) + 1 :]
    return rest[0] if rest and not rest[0].startswith("-") else None


def _vllm_argv(
    spec: EngineDeployment, lane: EngineLane, master_addr: str, bind_host: str
) -> list[str]:
    # The stub server parses exactly these flags, so `custom` keeps them byte for byte.
    argv = list(spec.command)
    if lane.rank == 0 and lane.port is not None:
        argv += ["--host", bind_host, "--port", str(lane.port)]
    argv += [
        "--tensor-parallel-size",
        str(spec.tensor_parallel),
        "--pipeline-parallel-size",
        str(spec.pipeline_parallel),
    ]
    if spec.data_parallel > 1:
        argv += _vllm_data_parallel(spec, lane, master_addr)
    if spec.enable_expert_parallel:
        # vLLM's expert-parallel group is TP × DP of one server, so the experts spread over
        # every GPU of the replica, across its nodes when its data-parallel ranks span several.
        argv.append("--enable-expert-parallel")
    if spec.data_parallel == 1 and spec.nodes_per_replica > 1 and lane.rendezvous_port is not None:
        # vLLM's multi-node launch without Ray: every node gets the same sizes, its rank and
        # the head's address; followers run headless (no API server).
        argv += [
            "--nnodes",
            str(spec.nodes_per_replica),
            "--node-rank",
            str(lane.rank),
        ]
        argv += _vllm_head(spec, lane, master_addr, "--master-addr", "--master-port")
    return argv


def _vllm_head(
    spec: EngineDeployment, lane: EngineLane, master_addr: str, addr_flag: str, port_flag: str
) -> list[str]:
    """The head's address and port under vLLM's flags for them, the rendezvous timeout, and
    `--headless` on every node but the head (no API server there)."""
    argv = [
        addr_flag,
        master_addr,
        port_flag,
        str(lane.rendezvous_port),
        "--distributed-timeout-seconds",
        f"{spec.distributed_timeout_s:g}",
    ]
    if lane.rank > 0:
        argv.append("--headless")
    return argv


def _vllm_data_parallel(spec: EngineDeployment, lane: EngineLane, master_addr: str) -> list[str]:
    """vLLM's data-parallel flags with its internal load balancing: one API server on the head
    node over every rank, each node running its share of the ranks (headless off the head)."""
    argv = ["--data-parallel-size", str(spec.data_parallel)]
    if spec.nodes_per_replica == 1 or lane.rendezvous_port is None:
        return argv
    local = spec.data_parallel // spec.nodes_per_replica
    argv += ["--data-parallel-size-local", str(local)]
    if lane.rank > 0:
        argv += ["--data-parallel-start-rank", str(lane.rank * local)]
    return argv + _vllm_head(
        spec, lane, master_addr, "--data-parallel-address", "--data-parallel-rpc-port"
    )


def _sglang_argv(
    spec: EngineDeployment, lane: EngineLane, master_addr: str, bind_host: str
) -> list[str]:
    argv = list(spec.command)
    if lane.rank == 0 and lane.port is not None:
        argv += ["--host", bind_host, "--port", str(lane.port)]
    # SGLang's sizes are the replica's totals: TP within a node here, PP one stage per node
    # (with nnodes = pp_size each node holds one pipeline stage of tp_size GPUs).
    argv += ["--tp-size", str(spec.tensor_parallel), "--pp-size", str(spec.pipeline_parallel)]
    if spec.enable_expert_parallel:
        argv += ["--ep-size", str(spec.tensor_parallel)]
    if spec.nodes_per_replica > 1 and lane.rendezvous_port is not None:
        host = f"[{master_addr}]" if ":" in master_addr else master_addr
        argv += [
            "--nnodes",
            str(spec.nodes_per_replica),
            "--node-rank",
            str(lane.rank),
            "--dist-init-addr",
            f"{host}:{lane.rendezvous_port}",
            "--dist-timeout",
            str(math.ceil(spec.distributed_timeout_s)),
        ]
    return [*argv, "--enable-metrics"]  # /metrics (the queue gauges) is off unless asked for


def _llamacpp_argv(
    spec: EngineDeployment, lane: EngineLane, master_addr: str, bind_host: str
) -> list[str]:
    # One process per replica on one node; a lane with several GPUs is split by llama.cpp's
    # own --split-mode (layers by default), which needs no launcher flag.
    argv = list(spec.command)
    if lane.port is not None:
        argv += ["--host", bind_host, "--port", str(lane.port)]
    return [*argv, "--metrics"]  # /metrics is off unless asked for


VLLM_QUEUE = QueueMetrics(waiting="vllm:num_requests_waiting", running="vllm:num_requests_running")

CUSTOM = EngineProfile(
    name="custom",
    summary="Any server with vLLM's flags and queue metric names whose /v1/models answers 200, "
    "like the stub server (`python -m slurmgate.testbed.stub_server`)",
    docs=("https://docs.vllm.ai/en/latest/serving/parallelism_scaling.html",),
    probes=Probes(models=True, lists_model=False),
    queue=VLLM_QUEUE,
    launcher_flags=flags.CUSTOM,
    render=_vllm_argv,
    roles=role_engines.CUSTOM_ROLES,
)

VLLM = EngineProfile(
    name="vllm",
    summary="vLLM's OpenAI-compatible server (`vllm serve`)",
    docs=(
        "https://docs.vllm.ai/en/latest/serving/parallelism_scaling.html",
        "https://docs.vllm.ai/en/latest/serving/data_parallel_deployment.html",
        "https://docs.vllm.ai/en/latest/usage/metrics.html",
        "https://docs.vllm.ai/en/latest/configuration/env_vars.html",
        "https://docs.vllm.ai/en/latest/features/nixl_connector_usage.html",
    ),
    probes=Probes(models=True, lists_model=True),
    queue=VLLM_QUEUE,
    launcher_flags=flags.VLLM,
    render=_vllm_argv,
    model_flags=("--model",),
    model_after="serve",
    served_name_flags=("--served-model-name",),
    host_ip_env="VLLM_HOST_IP",
    data_parallel=True,
    roles=role_engines.VLLM_ROLES,
    note="`data_parallel` above 1 makes a replica one vLLM server over that many ranks of "
    "`tensor_parallel` GPUs each (internal load balancing, for MoE models whose ranks step "
    "together): its ranks are spread evenly over `nodes_per_replica` nodes, and only the "
    "head serves HTTP. Independent replicas need no data-parallel flag: the endpoint "
    "balances them.",
)

SGLANG = EngineProfile(
    name="sglang",
    summary="SGLang's server (`python -m sglang.launch_server`)",
    docs=(
        "https://docs.sglang.ai/advanced_features/server_arguments.html",
        "https://docs.sglang.ai/references/multi_node_deployment/multi_node.html",
        "https://docs.sglang.ai/references/production_metrics.html",
        "https://docs.sglang.ai/references/environment_variables.html",
        "https://docs.sglang.ai/advanced_features/pd_disaggregation.html",
    ),
    probes=Probes(models=True, lists_model=True),
    queue=QueueMetrics(waiting="sglang:num_queue_reqs", running="sglang:num_running_reqs"),
    launcher_flags=flags.SGLANG,
    render=_sglang_argv,
    model_flags=("--model-path", "--model"),
    served_name_flags=("--served-model-name",),
    host_ip_env="SGLANG_HOST_IP",
    # With nnodes > 1 SGLang opens its ZMQ sockets on the --dist-init-addr port + 1 … + 6
    # (PortArgs.init_new in python/sglang/srt/server_args.py).
    rendezvous_span=7,
    note="The nodes of rank ≥ 1 serve no HTTP; only the head is probed and routed to.",
    roles=role_engines.SGLANG_ROLES,
)

LLAMACPP = EngineProfile(
    name="llamacpp",
    summary="llama.cpp's HTTP server (`llama-server`), one node per replica",
    docs=("https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md",),
    probes=Probes(models=False, lists_model=False, health_note="503 while the model loads"),
    queue=QueueMetrics(
        waiting="llamacpp:requests_deferred", running="llamacpp:requests_processing"
    ),
    launcher_flags=flags.LLAMACPP,
    render=_llamacpp_argv,
    model_flags=("-m", "--model"),
    served_name_flags=("-a", "--alias"),
    multi_node=False,
    expert_parallel=False,
    note="`tensor_parallel` is the number of GPUs one lane sees; llama.cpp spreads the model "
    "over them by its own `--split-mode` (layers by default), so no flag is appended.",
)


def _roles_only(
    spec: EngineDeployment, lane: EngineLane, master_addr: str, bind_host: str
) -> list[str]:
    raise AssertionError("the spec refuses this engine without roles")


TRTLLM_DOCS = (
    "https://nvidia.github.io/TensorRT-LLM/commands/trtllm-serve/trtllm-serve.html",
    "https://nvidia.github.io/TensorRT-LLM/features/disagg-serving.html",
    "https://github.com/NVIDIA/TensorRT-LLM/blob/main/tensorrt_llm/commands/serve.py",
)
DYNAMO_DOCS = (
    "https://docs.nvidia.com/dynamo/latest/",
    "https://docs.nvidia.com/dynamo/latest/guides/metrics.html",
    "https://github.com/NVIDIA/srt-slurm/tree/main/src/srtctl/backends",
)
# Dynamo's frontend exposes the queue; its workers have no OpenAI HTTP server.
DYNAMO_QUEUE = QueueMetrics(
    waiting="dynamo_frontend_queued_requests", running="dynamo_frontend_inflight_requests"
)

TRTLLM = EngineProfile(
    name="trtllm",
    summary="TensorRT-LLM's OpenAI server (`trtllm-serve MODEL`), one server per worker",
    docs=TRTLLM_DOCS,
    probes=Probes(models=True, lists_model=False),
    queue=QueueMetrics(
        waiting="trtllm_num_requests_waiting", running="trtllm_num_requests_running"
    ),
    launcher_flags=flags.TRTLLM,
    render=_roles_only,
    model_after="trtllm-serve",
    roles=role_engines.TRTLLM_ROLES,
    roles_only=True,
    note="Each role's `engine_config` is written as the worker's LLM-API YAML (`--config`) "
    "with the sizes the launcher owns (`tensor_parallel_size`, `pipeline_parallel_size`, "
    "`moe_expert_parallel_size`, `enable_attention_dp`) and, for prefill and decode, "
    "`cache_transceiver_config.backend` from `kv_transfer` (DEFAULT when unset). A worker "
    "over several nodes is one MPI world: one `srun --mpi=pmix` step, a rank per GPU, each "
    "running `mpi_launch` (`trtllm-llmapi-launch`) and the same argv; rank 0 serves.",
)


def _dynamo(name: EngineName, summary: str, roles: RoleSupport, model: str) -> EngineProfile:
    return EngineProfile(
        name=name,
        summary=summary,
        docs=DYNAMO_DOCS,
        probes=Probes(models=False, lists_model=False),
        queue=DYNAMO_QUEUE,
        launcher_flags=roles.launcher_flags,
        render=_roles_only,
        model_flags=(model,),
        served_name_flags=("--served-model-name",),
        roles=roles,
        roles_only=True,
        lane_http=False,
        frontend="dynamo",
        note="Workers register with etcd and serve Dynamo's frontend over its request plane "
        "(`frontend.request_plane`); they answer no client HTTP, so readiness is the "
        "frontend's `/health` listing every worker, and the endpoint routes to the frontend.",
    )


DYNAMO_SGLANG = _dynamo(
    "dynamo-sglang",
    "SGLang as a Dynamo worker (`python3 -m dynamo.sglang`)",
    role_engines.DYNAMO_SGLANG_ROLES,
    "--model-path",
)
DYNAMO_VLLM = _dynamo(
    "dynamo-vllm",
    "vLLM as a Dynamo worker (`python3 -m dynamo.vllm`)",
    role_engines.DYNAMO_VLLM_ROLES,
    "--model",
)
DYNAMO_TRTLLM = _dynamo(
    "dynamo-trtllm",
    "TensorRT-LLM as a Dynamo worker (`python3 -m dynamo.trtllm`)",
    role_engines.DYNAMO_TRTLLM_ROLES,
    "--model-path",
)

PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        CUSTOM,
        VLLM,
        SGLANG,
        LLAMACPP,
        TRTLLM,
        DYNAMO_SGLANG,
        DYNAMO_VLLM,
        DYNAMO_TRTLLM,
    )
}


def profile(name: str) -> EngineProfile:
    """The profile of an engine name the spec accepted."""
    return PROFILES[name]
