"""Each engine's launch of one role's worker (prefill, decode or agg): GPUs, argv and env.

A deployment with `roles` describes its workers in the engine's own sizes, as srt-slurm recipes
do: tensor, data, expert and pipeline parallel sizes of one worker, which may take part of a
node, a whole node or several nodes. A `RoleSupport` is what an engine profile knows of that:
how many GPUs a worker of given sizes takes, which combinations it cannot run, and what the
launcher appends to the deployment's command on each of a worker's processes (one per node).
Pure policy: no I/O, standard library only.

Sources, pinned per engine (the URLs are repeated in `profiles.py`'s profiles and checked by
tests/runtime/test_role_engines.py):
- SGLang PD: https://docs.sglang.ai/advanced_features/pd_disaggregation.html and
  https://docs.sglang.ai/advanced_features/server_arguments.html (`--disaggregation-mode`,
  `--disaggregation-bootstrap-port`, `--disaggregation-transfer-backend`, `--dist-init-addr`,
  `--nnodes`, `--node-rank`, `--nccl-port`, `--enable-dp-attention`).
- vLLM PD: https://docs.vllm.ai/en/latest/features/nixl_connector_usage.html
  (`--kv-transfer-config` with NixlConnector `kv_both`, `VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`) and
  https://docs.vllm.ai/en/latest/serving/data_parallel_deployment.html (per-node DP flags).
- srt-slurm's command builders (`src/srtctl/backends/{sglang,vllm,trtllm}.py`, v1.0.68), which
  InferenceX's recipes run through, for the order and the per-process ports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from slurmgate.runtime.engines import flags

PD_ROLES = ("prefill", "decode")
ROLE_NAMES = ("prefill", "decode", "agg")

# vLLM's connector names for the transfer backends a spec may name (srt-slurm's connector map:
# `nixl` is NixlConnector with kv_role kv_both, which both roles use).
VLLM_CONNECTORS: dict[str, dict[str, str]] = {
    "nixl": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    "lmcache": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
    "mooncake": {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"},
}
# SGLang's `--disaggregation-transfer-backend` choices (server_args.py, 0.5.x).
SGLANG_TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "mori", "fake")
# TensorRT-LLM's cache transceiver backends (`cache_transceiver_config.backend`).
TRTLLM_TRANSFER_BACKENDS = ("DEFAULT", "UCX", "NIXL", "MPI")


class RoleShape(Protocol):
    """What a role render reads of one role (`spec.RoleSpec` is one)."""

    @property
    def workers(self) -> int: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def data_parallel(self) -> int: ...
    @property
    def expert_parallel(self) -> int: ...
    @property
    def pipeline_parallel(self) -> int: ...
    @property
    def dp_attention(self) -> bool: ...
    @property
    def args(self) -> Sequence[str]: ...
    @property
    def env(self) -> Mapping[str, str]: ...


class RoleDeployment(Protocol):
    """What a role render reads of the deployment (`spec.DeploymentSpec` is one)."""

    @property
    def command(self) -> Sequence[str]: ...
    @property
    def kv_transfer(self) -> str | None: ...
    @property
    def distributed_timeout_s(self) -> float: ...
    @property
    def request_plane(self) -> str: ...


class RoleLane(Protocol):
    """What a role render reads of one process (`layout.LanePlan` is one)."""

    @property
    def role(self) -> str | None: ...
    @property
    def rank(self) -> int: ...
    @property
    def port(self) -> int | None: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...
    @property
    def rendezvous_port(self) -> int | None: ...
    @property
    def bootstrap_port(self) -> int | None: ...
    @property
    def side_port(self) -> int | None: ...
    @property
    def worker_nodes(self) -> int: ...


Problem = tuple[str, str, str]  # (field, message, fix), as spec.SpecError words them
RoleRender = Callable[[RoleDeployment, RoleShape, RoleLane, str, str], list[str]]
RoleEnv = Callable[[RoleDeployment, RoleShape, RoleLane, str], dict[str, str]]
RoleFiles = Callable[[RoleDeployment, RoleShape, RoleLane], dict[str, str]]

# In a lane's argv, the directory the node worker writes the lane's files into (one per lane,
# private to the run): `RoleSupport.files` names them, the argv refers to them under it.
LANE_DIR = "{lane_dir}"


def no_files(spec: RoleDeployment, role: RoleShape, lane: RoleLane) -> dict[str, str]:
    return {}


def tp_pp_dp(role: RoleShape) -> int:
    """GPUs of a worker whose data-parallel ranks each hold a full TP × PP model copy."""
    return role.tensor_parallel * role.pipeline_parallel * role.data_parallel


def tp_pp_dp_attention(role: RoleShape) -> int:
    """SGLang: with DP attention the data-parallel ranks live inside the TP group, so a
    worker is TP × PP GPUs; without it each DP rank is its own TP × PP copy."""
    dp = 1 if role.dp_attention else role.data_parallel
    return role.tensor_parallel * role.pipeline_parallel * dp


def tp_pp(role: RoleShape) -> int:
    """TensorRT-LLM: attention DP and MoE EP run over the TP ranks, so a worker is TP × PP."""
    return role.tensor_parallel * role.pipeline_parallel


@dataclass(frozen=True)
class RoleSupport:
    """What one engine knows of role workers."""

    worker_gpus: Callable[[RoleShape], int]
    render: RoleRender
    env: RoleEnv
    # The flags the launcher renders for a role: a role's `args` may not set them.
    launcher_flags: tuple[str, ...]
    transfer_backends: tuple[str, ...]
    # Consecutive ports a multi-node worker's head opens from its rendezvous port on.
    rendezvous_span: int = 1
    # Ports every process opens besides HTTP, from its side port on (NCCL, NIXL side channel
    # blocks, Dynamo's status server): the layout gives each lane slot its own block.
    side_span: Callable[[RoleShape], int] = lambda role: 1
    dp_attention: bool = True  # the engine has data-parallel attention
    # How the expert-parallel size relates to the worker: "within-tp" (SGLang: EP divides TP)
    # or "tp-times-dp" (vLLM: EP is TP × DP when on).
    expert_parallel: str = "within-tp"
    multi_node: bool = True
    # A worker over several nodes is one MPI world (a task per GPU under `srun --mpi=pmix`),
    # not a process per node that meets the others at a rendezvous address.
    mpi: bool = False
    # The role's settings go in a config file (`RoleSpec.engine_config`), not only flags.
    engine_config: bool = False
    # Files the lane reads, by name under LANE_DIR (a TensorRT-LLM engine YAML).
    files: RoleFiles = no_files
    # Keys of engine_config the launcher sets from the role's sizes.
    launcher_keys: tuple[str, ...] = ()

    def problems(self, engine: str, where: str, role: RoleShape) -> list[Problem]:
        """What this engine cannot run of one role, as (field, message, fix)."""
        found: list[Problem] = []
        tp, dp, ep = role.tensor_parallel, role.data_parallel, role.expert_parallel
        if role.dp_attention and not self.dp_attention:
            found.append(
                (
                    f"{where}.dp_attention",
                    f"engine {engine} has no data-parallel attention flag",
                    "turn dp_attention off (vLLM runs DP ranks as full copies)",
                )
            )
        if role.dp_attention and (dp < 2 or tp % dp):
            found.append(
                (
                    f"{where}.dp_attention",
                    f"DP attention splits the tensor_parallel={tp} ranks into data_parallel="
                    f"{dp} groups, which needs data_parallel ≥ 2 dividing tensor_parallel",
                    "set data_parallel to a divisor of tensor_parallel (often equal), or turn "
                    "dp_attention off",
                )
            )
        if ep > 1 and self.expert_parallel == "within-tp" and (ep > tp or tp % ep):
            found.append(
                (
                    f"{where}.expert_parallel",
                    f"expert_parallel={ep} must divide tensor_parallel={tp} (the experts are "
                    "sharded over the TP ranks)",
                    f"use a divisor of {tp}, often {tp}",
                )
            )
        if ep > 1 and self.expert_parallel == "tp-times-dp" and ep != tp * dp:
            found.append(
                (
                    f"{where}.expert_parallel",
                    f"engine {engine}'s expert-parallel group is tensor_parallel × "
                    f"data_parallel = {tp * dp}, not {ep}",
                    f"set expert_parallel: {tp * dp} (expert parallel on) or 1 (off)",
                )
            )
        config = getattr(role, "engine_config", None) or {}
        for key in self.launcher_keys:
            if key in config:
                found.append(
                    (
                        f"{where}.engine_config",
                        f"{key} is set by the launcher from the role's sizes",
                        f"remove {key}: use the role's fields (tensor_parallel, "
                        "expert_parallel, pipeline_parallel, dp_attention) or kv_transfer",
                    )
                )
        for i, arg in enumerate(role.args):
            flag = arg.split("=", 1)[0]
            if flag in self.launcher_flags:
                found.append(
                    (
                        f"{where}.args",
                        f"{flag} (argument {i}) is set by the launcher from the role's sizes "
                        "and the layout",
                        f"remove {flag}: use the role's fields (tensor_parallel, data_parallel, "
                        "expert_parallel, pipeline_parallel, dp_attention) or the deployment's "
                        "kv_transfer",
                    )
                )
        return found


def place(gpus: int, node_gpus: int) -> tuple[int, int]:
    """(nodes per worker, GPUs on each of them) of a worker of `gpus` GPUs."""
    if gpus <= node_gpus:
        return 1, gpus
    return math.ceil(gpus / node_gpus), node_gpus


def _head(argv: list[str], lane: RoleLane, bind_host: str) -> None:
    if lane.port is not None:
        argv += ["--host", bind_host, "--port", str(lane.port)]


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


# -- SGLang ------------------------------------------------------------------------------------


def sglang_role_argv(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, master_addr: str, bind_host: str
) -> list[str]:
    """`python -m sglang.launch_server` (or `dynamo.sglang`) for one process of a role worker.

    The order follows srt-slurm's `SGLangProtocol.build_worker_command`: host and port (the
    worker's head only), the disaggregation mode and, on a prefill worker, its bootstrap port
    (every node of the worker gets it: its ranks register with the head's bootstrap server),
    the sizes, the multi-node rendezvous, then the role's own args.
    """
    argv = list(spec.command)
    _head(argv, lane, bind_host)
    if lane.role in PD_ROLES:
        argv += ["--disaggregation-mode", str(lane.role)]
        if lane.bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(lane.bootstrap_port)]
        if spec.kv_transfer:
            argv += ["--disaggregation-transfer-backend", spec.kv_transfer]
    argv += ["--tp-size", str(role.tensor_parallel), "--pp-size", str(role.pipeline_parallel)]
    if role.data_parallel > 1:
        argv += ["--dp-size", str(role.data_parallel)]
    if role.dp_attention:
        argv.append("--enable-dp-attention")
    if role.expert_parallel > 1:
        argv += ["--ep-size", str(role.expert_parallel)]
    if lane.worker_nodes > 1 and lane.rendezvous_port is not None:
        argv += [
            "--nnodes",
            str(lane.worker_nodes),
            "--node-rank",
            str(lane.rank),
            "--dist-init-addr",
            f"{_host(master_addr)}:{lane.rendezvous_port}",
            "--dist-timeout",
            str(math.ceil(spec.distributed_timeout_s)),
        ]
    if lane.side_port is not None:
        # Fixed, so two workers packed on one node never race for SGLang's random pick.
        argv += ["--nccl-port", str(lane.side_port)]
    return [*argv, "--enable-metrics", *role.args]


def sglang_role_env(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, bind_host: str
) -> dict[str, str]:
    return {"SGLANG_HOST_IP": bind_host, **role.env}


SGLANG_ROLES = RoleSupport(
    worker_gpus=tp_pp_dp_attention,
    render=sglang_role_argv,
    env=sglang_role_env,
    launcher_flags=flags.SGLANG_ROLE,
    transfer_backends=SGLANG_TRANSFER_BACKENDS,
    # With nnodes > 1 SGLang opens its ZMQ sockets on the --dist-init-addr port + 1 … + 6.
    rendezvous_span=7,
)


# -- vLLM --------------------------------------------------------------------------------------


def kv_transfer_config(spec: RoleDeployment, role: RoleShape) -> list[str]:
    """`--kv-transfer-config JSON` from the deployment's kv_transfer, unless the role's own
    args carry one (a recipe's MultiConnector, say): theirs is used as written."""
    if any(a.split("=", 1)[0] == "--kv-transfer-config" for a in role.args):
        return []
    backend = spec.kv_transfer or "nixl"
    return ["--kv-transfer-config", json.dumps(VLLM_CONNECTORS[backend], separators=(",", ":"))]


def _vllm_topology(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, master_addr: str, *, hybrid_lb: bool
) -> list[str]:
    """vLLM's multi-node flags for one process, as srt-slurm's per-node launch renders them.

    A worker whose TP × PP replica spans nodes runs vLLM's multi-node executor over all its
    nodes (`--nnodes/--node-rank/--master-addr`), headless off the head. A worker whose
    replicas fit a node runs its data-parallel ranks per node (`--data-parallel-size-local`,
    `--data-parallel-start-rank`); with `hybrid_lb` (Dynamo) every node serves its own ranks,
    else the followers run headless behind the head's API server.
    """
    if lane.worker_nodes == 1 or lane.rendezvous_port is None:
        return []
    replica = role.tensor_parallel * role.pipeline_parallel
    argv: list[str] = []
    if replica > len(lane.gpus):
        argv += [
            "--nnodes",
            str(lane.worker_nodes),
            "--node-rank",
            str(lane.rank),
            "--master-addr",
            master_addr,
            "--master-port",
            str(lane.rendezvous_port),
        ]
        if role.data_parallel > 1:
            argv += [
                "--data-parallel-address",
                master_addr,
                "--data-parallel-rpc-port",
                str(lane.rendezvous_port + 1),
            ]
        if lane.rank > 0:
            argv.append("--headless")
    else:
        local = len(lane.gpus) // replica
        argv += [
            "--data-parallel-size-local",
            str(local),
            "--data-parallel-start-rank",
            str(lane.rank * local),
            "--data-parallel-address",
            master_addr,
            "--data-parallel-rpc-port",
            str(lane.rendezvous_port + 1),
        ]
        if hybrid_lb:
            argv.append("--data-parallel-hybrid-lb")
        elif lane.rank > 0:
            argv.append("--headless")
    return [*argv, "--distributed-timeout-seconds", f"{spec.distributed_timeout_s:g}"]


def vllm_role_argv(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, master_addr: str, bind_host: str
) -> list[str]:
    """`vllm serve` for one process of a role worker. Plain vLLM has no prefill/decode flag:
    its router decides the roles (vllm-router's `--prefill`/`--decode`), and both sides load
    the same connector (NixlConnector `kv_both`)."""
    argv = list(spec.command)
    _head(argv, lane, bind_host)
    argv += _vllm_sizes(role)
    if lane.role in PD_ROLES:
        argv += kv_transfer_config(spec, role)
    argv += _vllm_topology(spec, role, lane, master_addr, hybrid_lb=False)
    return [*argv, *role.args]


def _vllm_sizes(role: RoleShape) -> list[str]:
    argv = [
        "--tensor-parallel-size",
        str(role.tensor_parallel),
        "--pipeline-parallel-size",
        str(role.pipeline_parallel),
    ]
    if role.data_parallel > 1:
        argv += ["--data-parallel-size", str(role.data_parallel)]
    if role.expert_parallel > 1:
        argv.append("--enable-expert-parallel")
    return argv


def vllm_side_span(role: RoleShape) -> int:
    # NIXL's side channel listens on VLLM_NIXL_SIDE_CHANNEL_PORT + the local DP rank.
    return max(1, role.data_parallel)


def vllm_role_env(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, bind_host: str
) -> dict[str, str]:
    env = {"VLLM_HOST_IP": bind_host}
    if lane.role in PD_ROLES and lane.side_port is not None:
        # Without the routable host the side channel binds loopback and cross-node
        # transfers fail (srt-slurm sets both per process).
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = bind_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(lane.side_port)
    return {**env, **role.env}


VLLM_ROLES = RoleSupport(
    worker_gpus=tp_pp_dp,
    render=vllm_role_argv,
    env=vllm_role_env,
    launcher_flags=flags.VLLM,
    transfer_backends=tuple(VLLM_CONNECTORS),
    # --master-port, and the data-parallel RPC port after it.
    rendezvous_span=2,
    side_span=vllm_side_span,
    dp_attention=False,
    expert_parallel="tp-times-dp",
)


# -- custom (the stub server) ------------------------------------------------------------------


def custom_role_argv(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, master_addr: str, bind_host: str
) -> list[str]:
    """vLLM's size and rendezvous words plus SGLang's role words, which a stub engine playing
    prefill and decode behind a PD router parses."""
    argv = list(spec.command)
    _head(argv, lane, bind_host)
    argv += _vllm_sizes(role)
    if lane.role in PD_ROLES:
        argv += ["--disaggregation-mode", str(lane.role)]
        if lane.bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(lane.bootstrap_port)]
    if lane.worker_nodes > 1 and lane.rendezvous_port is not None:
        argv += [
            "--nnodes",
            str(lane.worker_nodes),
            "--node-rank",
            str(lane.rank),
            "--master-addr",
            master_addr,
            "--master-port",
            str(lane.rendezvous_port),
            "--distributed-timeout-seconds",
            f"{spec.distributed_timeout_s:g}",
        ]
        if lane.rank > 0:
            argv.append("--headless")
    return [*argv, *role.args]


def plain_role_env(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, bind_host: str
) -> dict[str, str]:
    return dict(role.env)


CUSTOM_ROLES = RoleSupport(
    worker_gpus=tp_pp_dp,
    render=custom_role_argv,
    env=plain_role_env,
    launcher_flags=flags.CUSTOM_ROLE,
    transfer_backends=SGLANG_TRANSFER_BACKENDS,
    dp_attention=False,
    expert_parallel="tp-times-dp",
)


# -- Dynamo workers ----------------------------------------------------------------------------
# https://docs.nvidia.com/dynamo/latest/ (backends sglang, vllm, trtllm; `--disaggregation-mode`
# since Dynamo 1.0, `--request-plane`), and srt-slurm's builders: a Dynamo worker is the
# engine's own flags plus Dynamo's, registers with etcd (discovery) and serves the frontend
# over the request plane, not over HTTP.


def dynamo_sglang_argv(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, master_addr: str, bind_host: str
) -> list[str]:
    """`python3 -m dynamo.sglang`: SGLang's flags, then the request plane (srt-slurm order)."""
    argv = sglang_role_argv(spec, role, lane, master_addr, bind_host)
    cut = len(argv) - len(role.args)
    return [*argv[:cut], "--request-plane", spec.request_plane, *role.args]


def dynamo_vllm_argv(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, master_addr: str, bind_host: str
) -> list[str]:
    """`python3 -m dynamo.vllm`: the role as `--disaggregation-mode` (Dynamo 1.0's word, which
    replaced `--is-prefill-worker`), the connector, per-node DP with hybrid load balancing so
    every node's process registers, then the request plane."""
    argv = list(spec.command)
    if lane.role in PD_ROLES:
        argv += ["--disaggregation-mode", str(lane.role)]
        argv += kv_transfer_config(spec, role)
    argv += _vllm_sizes(role)
    argv += _vllm_topology(spec, role, lane, master_addr, hybrid_lb=True)
    return [*argv, "--request-plane", spec.request_plane, *role.args]


def dynamo_vllm_env(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, bind_host: str
) -> dict[str, str]:
    env = vllm_role_env(spec, role, lane, bind_host)
    if lane.side_port is not None:
        env["DYN_SYSTEM_PORT"] = str(lane.side_port + vllm_side_span(role))
    return {**env, **role.env}


def dynamo_sglang_env(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, bind_host: str
) -> dict[str, str]:
    env = {"SGLANG_HOST_IP": bind_host}
    if lane.side_port is not None:
        env["DYN_SYSTEM_PORT"] = str(lane.side_port + 1)  # after SGLang's NCCL port
    return {**env, **role.env}


# -- TensorRT-LLM ------------------------------------------------------------------------------
# `trtllm-serve MODEL` (tensorrt_llm/commands/serve.py: --tp_size/--pp_size/--ep_size, --config
# is the LLM-API YAML that overrides them, --host/--port) and its disaggregated service
# (https://nvidia.github.io/TensorRT-LLM/features/disagg-serving.html: context and generation
# servers need `cache_transceiver_config` in their YAML). A worker on several nodes is an MPI
# world: one `srun --mpi=pmix` step with a task per GPU, every rank running the deployment's
# `mpi_launch` (`trtllm-llmapi-launch`) before the server argv, as srt-slurm launches it
# (src/srtctl/backends/trtllm.py at c88ef731: `get_srun_config`, `build_worker_command`).


def trtllm_config(spec: RoleDeployment, role: RoleShape, lane: RoleLane) -> dict[str, Any]:
    """The role's LLM-API YAML: its engine_config, with the sizes the launcher owns."""
    config: dict[str, Any] = dict(getattr(role, "engine_config", None) or {})
    config |= {
        "tensor_parallel_size": role.tensor_parallel,
        "pipeline_parallel_size": role.pipeline_parallel,
        "moe_expert_parallel_size": role.expert_parallel,
        "enable_attention_dp": role.dp_attention,
    }
    if lane.role in PD_ROLES:
        # the role's own transceiver settings (max_tokens_in_buffer, …) stay; the backend is
        # the deployment's kv_transfer
        own = config.get("cache_transceiver_config")
        own = dict(own) if isinstance(own, dict) else {}
        config["cache_transceiver_config"] = {**own, "backend": spec.kv_transfer or "DEFAULT"}
    return config


def trtllm_config_name(lane: RoleLane) -> str:
    return f"trtllm-{lane.role}.yaml"


def trtllm_files(spec: RoleDeployment, role: RoleShape, lane: RoleLane) -> dict[str, str]:
    # JSON is YAML, and the standard library writes it (node workers import no yaml).
    return {trtllm_config_name(lane): json.dumps(trtllm_config(spec, role, lane), indent=1)}


def trtllm_role_argv(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, master_addr: str, bind_host: str
) -> list[str]:
    argv = list(spec.command)
    _head(argv, lane, bind_host)
    argv += ["--tp_size", str(role.tensor_parallel), "--pp_size", str(role.pipeline_parallel)]
    if role.expert_parallel > 1:
        argv += ["--ep_size", str(role.expert_parallel)]
    argv += ["--config", f"{LANE_DIR}/{trtllm_config_name(lane)}"]
    return [*argv, *role.args]


def dynamo_trtllm_argv(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, master_addr: str, bind_host: str
) -> list[str]:
    """`python3 -m dynamo.trtllm`: the sizes live in the engine YAML (srt-slurm's
    `--extra-engine-args`), the role in `--disaggregation-mode`."""
    argv = list(spec.command)
    if lane.role in PD_ROLES:
        argv += ["--disaggregation-mode", str(lane.role)]
    argv += ["--extra-engine-args", f"{LANE_DIR}/{trtllm_config_name(lane)}"]
    return [*argv, "--request-plane", spec.request_plane, *role.args]


def trtllm_env(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, bind_host: str
) -> dict[str, str]:
    return dict(role.env)


def dynamo_trtllm_env(
    spec: RoleDeployment, role: RoleShape, lane: RoleLane, bind_host: str
) -> dict[str, str]:
    assert lane.side_port is not None
    return {"DYN_SYSTEM_PORT": str(lane.side_port), **role.env}


TRTLLM_ROLES = RoleSupport(
    worker_gpus=tp_pp,
    render=trtllm_role_argv,
    env=trtllm_env,
    launcher_flags=flags.TRTLLM,
    transfer_backends=TRTLLM_TRANSFER_BACKENDS,
    mpi=True,
    engine_config=True,
    files=trtllm_files,
    launcher_keys=flags.TRTLLM_CONFIG_KEYS,
)

DYNAMO_SGLANG_ROLES = RoleSupport(
    worker_gpus=tp_pp_dp_attention,
    render=dynamo_sglang_argv,
    env=dynamo_sglang_env,
    launcher_flags=flags.DYNAMO_SGLANG,
    transfer_backends=SGLANG_TRANSFER_BACKENDS,
    rendezvous_span=7,
    side_span=lambda role: 2,  # SGLang's NCCL port, then DYN_SYSTEM_PORT
)

DYNAMO_VLLM_ROLES = RoleSupport(
    worker_gpus=tp_pp_dp,
    render=dynamo_vllm_argv,
    env=dynamo_vllm_env,
    launcher_flags=flags.DYNAMO_VLLM,
    transfer_backends=tuple(VLLM_CONNECTORS),
    rendezvous_span=2,
    side_span=lambda role: vllm_side_span(role) + 1,  # the NIXL block, then DYN_SYSTEM_PORT
    dp_attention=False,
    expert_parallel="tp-times-dp",
)

DYNAMO_TRTLLM_ROLES = RoleSupport(
    worker_gpus=tp_pp,
    render=dynamo_trtllm_argv,
    env=dynamo_trtllm_env,
    launcher_flags=flags.DYNAMO_TRTLLM,
    transfer_backends=TRTLLM_TRANSFER_BACKENDS,
    mpi=True,
    engine_config=True,
    files=trtllm_files,
    launcher_keys=flags.TRTLLM_CONFIG_KEYS,
)


def json_safe(value: Any, depth: int = 0) -> bool:
    """A YAML/JSON value of plain scalars, lists and string-keyed mappings, bounded in depth."""
    if depth > 16:
        return False
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list):
        return all(json_safe(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and json_safe(v, depth + 1) for k, v in value.items())
    return False
