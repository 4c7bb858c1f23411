"""An InferenceX AMD multi-node job-mix row as an allocation spec: the SGLang roles its scripts run.

The job mix's 48 rows from InferenceX's `configs/amd-master.yaml` name no srt-slurm recipe: on
the AMD runners a row is launched by shell scripts (`runners/launch_mi355x-amds.sh`, the row's
`benchmarks/multi_node/<prefix>_<precision>_mi355x_<framework>.sh`, then `amd_utils/submit.sh`,
`job.slurm`, `env.sh` and `server_sglang.sh`). `spec_from_row` reads the row's config block
(slurmgate/data/inferencex-amd/amd-master-disagg.yaml, a verbatim excerpt) and the scripts'
models.yaml (a verbatim copy), and builds what `server_sglang.sh` starts at commit 843c6254f:

- each role's workers in SGLang's own sizes (`--tp-size` of NODES × TP / WORKERS, `--ep-size`
  and `--dp-size` equal to it when `ep` > 1 or `dp-attn`), on 8-GPU nodes;
- its flags, by `build_server_config`: the model's base flags, EP flags when EP is on, MTP
  flags on both roles with `--speculative-num-steps N --speculative-num-draft-tokens N+1`, DP
  flags, then the role's mode flags (memory fraction, running requests, chunked prefill,
  CUDA-graph batch sizes, radix cache, context length), and HiCache's flags on agentic rows;
- the `mori` transfer backend (models.yaml's `--disaggregation-transfer-backend`), the node's
  RDMA devices as `--disaggregation-ib-device` (the runner's `IBDEVICES`, also `NCCL_IB_HCA`)
  and `MORI_RDMA_TC`;
- the env of env.sh's SGLang branch (and its DeepSeek-V4-Pro block), and each role's own MoRI
  env from the prefill and decode command lines;
- sglang-router in PD mode as the frontend, with the script's policy and resilience flags.

What the scripts do that a spec does not carry is reported (`Reported`, as srt-slurm recipes'
keys are); a row slurmgate cannot run is refused by name (`RowRefused`): an ATOM row, or a row
that has a recipe (`slurmgate spec from-recipe` builds those).
"""

from __future__ import annotations

import csv
import functools
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slurmgate.errors import InputError
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.runtime.spec.from_recipe import DEFAULT_MODEL, Reported

DATA = Path(__file__).resolve().parents[2] / "data"
AMD = DATA / "inferencex-amd"
JOB_MIX = DATA / "inferencex-job-mix.csv"
SOURCE = "configs/amd-master.yaml"
GPUS_PER_NODE = 8  # runners/launch_mi355x-amds.sh: GPUS_PER_NODE=8 (MI355X)
# runners/launch_mi355x-amds.sh sets these for every node of the allocation.
IB_DEVICES = "rdma0,rdma1,rdma2,rdma3,rdma4,rdma5,rdma6,rdma7"
MORI_RDMA_TC = "104"
TIME_LIMIT = "08:00:00"  # the launch scripts' TIME_LIMIT
ROUTER_PORT = 30000  # server_sglang.sh's router port, replaced by the frontend's
_IB_DEVICE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

# env.sh, SGLang branch (ENGINE sglang-disagg), and its shared MoRI-IO block, as exported for
# every server process. Harness inputs it also exports (MORI_MAX_DISPATCH_TOKENS_*,
# MORI_MOE_MAX_INPUT_TOKENS_*, MORI_COMBINE_DTYPE_*) become the roles' own SGLANG_MORI_* env
# below, as server_sglang.sh passes them on each command line.
SGLANG_ENV = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "MORI_IO_QP_MAX_CQE": "32768",
    "MORI_IO_QP_MAX_SGE": "2",
    "MORI_IO_TC_DISABLE": "0",
    "SGLANG_USE_AITER": "1",
    "AITER_LOG_LEVEL": "ERROR",
    "SGLANG_MORI_DISPATCH_DTYPE": "auto",
    "SGLANG_MORI_QP_PER_TRANSFER": "4",
    "SGLANG_MORI_NUM_WORKERS": "4",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "3600",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3600",
    "SGLANG_HEALTH_CHECK_TIMEOUT": "600",
    "MORI_SHMEM_MODE": "ISOLATION",
    "SGLANG_ENABLE_SPEC_V2": "1",
    "SGLANG_ENABLE_OVERLAP_PLAN_STREAM": "0",
    "SGLANG_LOG_MS": "true",
    "SGLANG_DISAGGREGATION_NUM_PRE_ALLOCATE_REQS": "32",
    "MORI_EP_LAUNCH_CONFIG_MODE": "AUTO",
    "MORI_APP_LOG_LEVEL": "WARNING",
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "NCCL_BLOCKING_WAIT": "1",
}
# env.sh's DeepSeek-V4-Pro block (MODEL_NAME DeepSeek-V4-Pro), which wins over the above.
DSV4_ENV = {
    "SGLANG_AITER_MLA_PERSIST": "0",
    "HSA_NO_SCRATCH_RECLAIM": "0",
    "SGLANG_ENABLE_UNIFIED_RADIX_TREE": "1",
    "SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS": "1",
    "SGLANG_MORI_DISPATCH_DTYPE": "auto",
    "SGLANG_DEFAULT_THINKING": "1",
    "SGLANG_DSV4_REASONING_EFFORT": "high",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "false",
    "SGLANG_USE_AITER": "1",
    "SGLANG_USE_ROCM700A": "0",
    "SGLANG_OPT_USE_FUSED_COMPRESS": "true",
    "SGLANG_HACK_FLASHMLA_BACKEND": "unified_kv_triton",
    "SGLANG_OPT_FP8_WO_A_GEMM": "false",
    "SGLANG_OPT_USE_JIT_INDEXER_METADATA": "false",
    "SGLANG_OPT_USE_TOPK_V2": "false",
    "SGLANG_OPT_USE_AITER_INDEXER": "true",
    "SGLANG_OPT_USE_TILELANG_INDEXER": "false",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "false",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "false",
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
    "SGLANG_OPT_USE_FUSED_COMPRESS_TRITON": "true",
    "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP": "false",
    "SGLANG_ROCM_USE_MULTI_STREAM": "false",
    "AITER_BF16_FP8_MOE_BOUND": "0",
    "SGLANG_EAGER_INPUT_NO_COPY": "true",
    "SGLANG_SHARED_EXPERT_TP1": "1",
    "SGLANG_DP_SHARED_EXPERT_LOCAL": "1",
    "SGLANG_DP_USE_GATHERV": "1",
    "SGLANG_DP_USE_REDUCE_SCATTER": "1",
    "GPU_MAX_HW_QUEUES": "5",
}
DSV4 = "DeepSeek-V4-Pro"
# server_sglang.sh's golden acceptance lengths for agentic DeepSeek-V4 MTP, by draft depth.
DSV4_GOLDEN_AL = {1: "1.79", 2: "2.27", 3: "2.49"}
# The agentic recipe script's HiCache exports (benchmarks/multi_node/agentic/
# dsv4_fp4_mi355x_sglang-disagg.sh, tier L2: no Mooncake store), as server_sglang.sh's
# build_hicache_flags renders them with FORCE_HICACHE_RATIO=1.
AGENTIC_HICACHE = {
    "page_size": "256",
    "ratio": "3",
    "io_backend": "direct",
    "mem_layout": "page_first",
    "write_policy": "write_through",
    "prefetch_policy": "best_effort",
}
# server_sglang.sh's router flags: fixed-sequence-length ("DI") rows, and agentic ones (the
# agentic script exports PREFILL_ROUTER_POLICY=consistent_hashing).
ROUTER_DI = [
    *("--policy", "random", "--prefill-policy", "random", "--decode-policy", "random"),
    *("--cb-timeout-duration-secs", "15", "--retry-max-retries", "3"),
]
ROUTER_AGENTIC = [
    *("--policy", "consistent_hashing", "--dp-aware", "--cache-threshold", "0.3"),
    *("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.1"),
    *("--disable-circuit-breaker", "--health-failure-threshold", "100"),
    *("--health-check-timeout-secs", "600", "--health-check-interval-secs", "30"),
]
# Flags the launcher sets from the role's fields: lifted out of models.yaml's flag strings.
_OWNED = ("--enable-dp-attention", "--disaggregation-transfer-backend")

REPORTED = {
    "image": "the workers run the SGLang installed on the nodes, not in this container: "
    "install that version there",
    "router": "sglang-router is the one installed on the client node: install this version",
    "model path": "the scripts load /models/<name> in the container and serve it under that "
    "path; the spec loads the path given with --model (default /model) and serves it under "
    "the row's model name",
    "--host 0.0.0.0 --port 8000": "replaced: the layout gives each worker its address and "
    "port; the router's port 30000 is the frontend's port",
    "setup_deps.sh": "not run: it installs packages into the container (ibv_devinfo, "
    "amd-quark) and patches SGLang; the nodes' environment must already hold them",
    "IBDEVICES auto-detection": "env.sh detects the RDMA devices with ibv_devinfo when the "
    "runner sets none; every node here gets the devices given with --ib-devices",
    "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME": "not set: env.sh takes each node's default-route "
    "interface, which Gloo and NCCL also pick themselves",
    "PYTHONPATH": "/sgl-workspace/aiter (a path in the container) is not prepended",
    "rdma_check.sh": "job.slurm's RDMA/QoS preflight is not run",
    "node_excludes.yaml": "no nodes are excluded by framework and model",
}


class RowRefused(InputError):
    """A job-mix row slurmgate does not build from the AMD scripts; the message says why."""


class RowError(InputError):
    """A row id or option that names nothing to build; the message names it and the fix."""


@dataclass
class RowSpec:
    """The spec a job-mix row becomes, and what of its scripts it runs differently."""

    spec: AllocationSpec
    row_id: str
    reported: list[Reported] = field(default_factory=list)

    def yaml(self) -> str:
        """The spec as YAML, headed by comments naming the row and every reported item."""
        data = self.spec.model_dump(mode="json", exclude_defaults=True)
        head = [f"# From the InferenceX job-mix row {self.row_id} ({SOURCE}, AMD scripts)."]
        head += [f"# reported: {r.line()}" for r in self.reported]
        return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, width=100)


@functools.cache
def mix_rows() -> dict[str, dict[str, str]]:
    """The job mix's rows by row id."""
    with JOB_MIX.open(newline="") as handle:
        return {row["row_id"]: row for row in csv.DictReader(handle)}


@functools.cache
def amd_configs() -> dict[str, dict[str, Any]]:
    """The AMD multi-node disaggregated config blocks, by config key."""
    data = yaml.safe_load((AMD / "amd-master-disagg.yaml").read_text())
    assert isinstance(data, dict)
    return data


@functools.cache
def models_yaml() -> dict[str, dict[str, Any]]:
    """amd_utils/models.yaml: SGLang's flags per model entry."""
    data = yaml.safe_load((AMD / "models.yaml").read_text())
    assert isinstance(data, dict)
    return data


def matrix_rows(key: str) -> list[dict[str, Any]]:
    """The matrix rows InferenceX's sweep generator emits for one config key, in its order:
    per fixed-sequence-length entry and sequence length one row with the entry's whole
    concurrency list; per agentic entry one row per concurrency (its
    MAX_MULTINODE_AGENTIC_CONCURRENCIES_PER_ALLOCATION is 1). Each row carries what
    `slurmgate.ci.nodecount` reads and what the scripts are given."""
    config = amd_configs()[key]
    base = {
        "config-key": key,
        "runner": config["runner"],
        "multinode": config.get("multinode", False),
        "disagg": config.get("disagg", False),
    }
    rows: list[dict[str, Any]] = []
    scenarios = config.get("scenarios") or {}
    for seq in scenarios.get("fixed-seq-len") or []:
        for entry in seq["search-space"]:
            rows.append(
                {
                    **base,
                    **_entry(entry),
                    "scenario": "fixed-seq-len",
                    "isl": seq["isl"],
                    "osl": seq["osl"],
                    "conc": list(entry["conc-list"]),
                }
            )
    for agentic in scenarios.get("agentic-coding") or []:
        for entry in agentic["search-space"]:
            for conc in entry["conc-list"]:
                rows.append({**base, **_entry(entry), "scenario": "agentic-coding", "conc": [conc]})
    return rows


def _entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("prefill", "decode", "spec-decoding", "kv-offloading", "kv-offload-backend")
    return {k: entry[k] for k in keep if k in entry}


def matrix_row(row_id: str) -> dict[str, Any]:
    """The matrix row of a job-mix row id from the AMD config (`<config-key>#<index>`)."""
    key, _, index = row_id.rpartition("#")
    if key not in amd_configs() or not index.isdigit():
        raise RowError(
            f"{row_id}: not a row of InferenceX's AMD multi-node configs — give a row_id of "
            f"slurmgate/data/inferencex-job-mix.csv whose source_file is {SOURCE}"
        )
    rows = matrix_rows(key)
    if int(index) >= len(rows):
        raise RowError(f"{row_id}: {key} has rows #0 to #{len(rows) - 1} — pick one of those")
    return rows[int(index)]


def _settings(role: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in role.get("additional-settings") or []:
        name, _, value = str(item).partition("=")
        out[name] = value
    return out


def spec_from_row(
    row_id: str,
    *,
    model: str | None = None,
    ib_devices: str = IB_DEVICES,
    name: str | None = None,
) -> RowSpec:
    """Build the spec of one job-mix row from InferenceX's AMD scripts (see the module
    docstring); RowRefused for a row they do not launch as SGLang, RowError for bad input."""
    mix = mix_rows().get(row_id)
    if mix is None:
        raise RowError(
            f"{row_id}: no such row_id in slurmgate/data/inferencex-job-mix.csv — copy one "
            "from its row_id column, e.g. dsr1-fp8-mi355x-sglang-disagg#0"
        )
    if mix["source_file"] != SOURCE:
        how = (
            f"slurmgate spec from-recipe with its recipe ({mix['recipe']})"
            if mix["recipe"]
            else "no spec: its recipe was not checked in at the snapshot"
        )
        raise RowRefused(
            f"{row_id}: from {mix['source_file']}, launched by an srt-slurm recipe, not by the "
            f"AMD scripts — build it with {how}"
        )
    if not all(_IB_DEVICE.match(d) for d in ib_devices.split(",")):
        raise RowError(
            f"--ib-devices: {ib_devices!r} is not a comma-separated list of RDMA device names "
            f"— give them as ibv_devinfo lists them, e.g. {IB_DEVICES}"
        )
    row = matrix_row(row_id)
    config = amd_configs()[row["config-key"]]
    framework = config.get("framework")
    if framework == "atom-disagg":
        raise RowRefused(
            f"{row_id}: framework atom-disagg: cannot be represented — ATOM, AMD's own engine, "
            "runs its own server (amd_utils/server_atom.sh) with a Mooncake KV transfer behind "
            "the atomesh router; slurmgate has no ATOM engine profile (its launch flags, "
            "readiness and queue metric) and no atomesh frontend. Run it with InferenceX's "
            "scripts"
        )
    if framework != "sglang-disagg":
        raise RowRefused(f"{row_id}: framework {framework!r}: only sglang-disagg rows are built")
    return _Build(row_id, row, config, mix, ib_devices).spec(model, name)


class _Build:
    """One row's translation of server_sglang.sh."""

    def __init__(
        self,
        row_id: str,
        row: Mapping[str, Any],
        config: Mapping[str, Any],
        mix: Mapping[str, str],
        ib_devices: str,
    ) -> None:
        self.row_id, self.row, self.config, self.ib = row_id, row, config, ib_devices
        self.mix = mix
        self.reported: list[Reported] = []
        self.model_name = str(config["model"]).rsplit("/", 1)[-1]  # MODEL_NAME=${MODEL##*/}
        self.agentic = row["scenario"] == "agentic-coding"
        self.max_conc = max(int(c) for c in row["conc"])
        self.settings = {**_settings(row["prefill"]), **_settings(row["decode"])}
        self.mtp = int(self.settings.get("DECODE_MTP_SIZE", "0") or 0)
        key = f"{self.model_name}-AgentX" if self.agentic else f"{self.model_name}-DI"
        models = models_yaml()
        if key not in models:
            key = self.model_name
        if key not in models:
            raise RowRefused(f"{row_id}: models.yaml has no entry {key}: the scripts stop there")
        self.entry_key, self.entry = key, models[key]
        self.two_batch = False  # the prefill's two-batch overlap (MORI_ENABLE_SDMA)
        self.hicache = (
            self.agentic
            and row.get("kv-offloading", "none") != "none"
            and (row.get("kv-offload-backend") or {}).get("name", "hicache") == "hicache"
        )

    def report(self, key: str, how: str | None = None) -> None:
        self.reported.append(Reported(key, how or REPORTED[key]))

    # -- sizes ---------------------------------------------------------------------------------

    def _role(self, role: str) -> dict[str, Any]:
        spec = self.row[role]
        workers, tp = int(spec["num-worker"]), int(spec["tp"])
        nodes = int(self.settings.get(f"{role.upper()}_NODES", "0") or 0)
        if nodes < 1 or (nodes * tp) % workers:
            raise RowRefused(
                f"{self.row_id}: {role}: {role.upper()}_NODES={nodes} with {workers} worker(s) "
                f"of TP {tp}: submit.sh's TP size (nodes × TP / workers) is not a whole number"
            )
        size = nodes * tp // workers  # submit.sh: PREFILL_TP_SIZE=$((NODES * TP / WORKERS))
        ep, dp = int(spec.get("ep", 1)) != 1, spec.get("dp-attn") is True
        out: dict[str, Any] = {"workers": workers, "tensor_parallel": size}
        if ep:
            out["expert_parallel"] = size
        if dp:
            out["data_parallel"], out["dp_attention"] = size, True
        if size >= GPUS_PER_NODE:
            planned = workers * -(-size // GPUS_PER_NODE)
        else:
            # server_sglang.sh gives a partial-node worker a node of its own: ceil(TP / 8)
            # nodes per worker, one server per node
            out["workers_per_node"] = 1
            planned = workers
        if planned != nodes:
            raise RowRefused(
                f"{self.row_id}: {role.upper()}_NODES={nodes}, but server_sglang.sh places "
                f"{workers} worker(s) of TP {size} on {planned} node(s) — the row's count and "
                "its scripts disagree"
            )
        return out

    # -- flags ---------------------------------------------------------------------------------

    def _split(self, text: str) -> list[str]:
        return shlex.split(text or "")

    def _formula(self, value: Any, env: Mapping[str, int]) -> int:
        """models.yaml's chunked_prefill_size: an integer, or a product of harness variables
        (server_sglang.sh evaluates it over the environment's integer variables)."""
        if isinstance(value, int):
            return value
        product = 1
        for term in str(value).split("*"):
            term = term.strip()
            if term.isdigit():
                product *= int(term)
            elif term in env:
                product *= env[term]
            else:
                raise RowRefused(
                    f"{self.row_id}: models.yaml {self.entry_key}: chunked_prefill_size "
                    f"{value!r} names {term!r}, which the scripts do not set"
                )
        return product

    @staticmethod
    def _range(text: str, default: tuple[int, int]) -> list[str]:
        start, end = default
        if "-" in str(text):
            a, b = str(text).split("-")
            start, end = int(a), int(b)
        return [str(i) for i in range(start, end + 1)]

    def _flags(self, roles: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, list[str]], str]:
        """Each role's flags as build_server_config composes them, and the transfer backend
        lifted out of the base flags."""
        m = self.entry
        base = self._split(m.get("base_flags", ""))
        backend = "mooncake"  # SGLang's default when models.yaml names none
        if "--disaggregation-transfer-backend" in base:
            i = base.index("--disaggregation-transfer-backend")
            backend = base[i + 1]
            del base[i : i + 2]
        wanted = self.config.get("kv-p2p-transfer")
        if wanted and wanted != backend:
            self.report(
                "kv-p2p-transfer",
                f"{wanted}: job.slurm does not pass KV_P2P_TRANSFER into the container, so "
                f"models.yaml's {backend} is used, as here",
            )
        tp = {r: int(roles[r]["tensor_parallel"]) for r in roles}
        ep = {r: "expert_parallel" in roles[r] for r in roles}
        dp = {r: bool(roles[r].get("dp_attention")) for r in roles}
        harness = {
            "MORI_MAX_DISPATCH_TOKENS_PREFILL": 8192,
            "MORI_MAX_DISPATCH_TOKENS_DECODE": 64 if self.model_name == DSV4 else 512,
            "PREFILL_TP_SIZE": tp["prefill"],
            "DECODE_TP_SIZE": tp["decode"],
        }
        p, d = m.get("prefill") or {}, m.get("decode") or {}
        # prefill mode flags
        if dp["prefill"]:
            cfg = p.get("dp") or {}
            cuda_bs = str(cfg.get("cuda_graph_bs", "1 2 3")).split()
            running = int(cfg.get("max_running_requests", 24))
            two_batch = bool(cfg.get("enable_two_batch_overlap", False))
        else:
            cfg = p.get("no_dp") or {}
            cuda_bs = self._range(cfg.get("cuda_graph_bs_range", "1-128"), (1, 128))
            running = int(cfg.get("max_running_requests", 128))
            two_batch = False
        chunk = self._formula(cfg.get("chunked_prefill_size", 262144), harness)
        p_ctx, p_total = cfg.get("context_length", ""), cfg.get("max_total_tokens", "")
        if dp["prefill"] and ep["prefill"]:
            running = self.max_conc
        prefill = [
            *("--mem-fraction-static", str(p.get("mem_fraction_static", 0.8))),
            *("--max-running-requests", str(running), "--chunked-prefill-size", str(chunk)),
        ]
        prefill += (
            ["--disable-cuda-graph"]
            if p.get("disable_cuda_graph", False)
            else ["--cuda-graph-bs", *cuda_bs]
        )
        if p.get("disable_radix_cache", True) and not self.agentic:
            prefill.append("--disable-radix-cache")
        if p_ctx != "":
            prefill += ["--context-length", str(p_ctx)]
        if p_total != "":
            prefill += ["--max-total-tokens", str(p_total)]
        if two_batch:
            prefill.append("--enable-two-batch-overlap")
        self.two_batch = two_batch
        # decode mode flags: DP, else EP only, else neither
        if dp["decode"]:
            cfg = d.get("dp") or {}
            cuda_bs = self._range(cfg.get("cuda_graph_bs_range", "1-160"), (1, 160))
            running = int(cuda_bs[-1]) * tp["decode"]
        elif ep["decode"]:
            cfg = d.get("ep_only") or {}
            cuda_bs = self._range(cfg.get("cuda_graph_bs_range", "1-256"), (1, 256))
            running = int(cfg.get("max_running_requests", 256))
        else:
            cfg = d.get("no_dp") or {}
            cuda_bs = self._range(cfg.get("cuda_graph_bs_range", "1-128"), (1, 128))
            running = int(cfg.get("max_running_requests", 128))
        d_ctx = cfg.get("context_length", "") or p_ctx
        if dp["decode"] and ep["decode"]:
            running = self.max_conc
        decode = [
            *("--mem-fraction-static", str(d.get("mem_fraction_static", 0.85))),
            *("--max-running-requests", str(running), "--cuda-graph-bs", *cuda_bs),
        ]
        if d.get("prefill_round_robin_balance", True):
            decode.append("--prefill-round-robin-balance")
        if d_ctx != "":
            decode += ["--context-length", str(d_ctx)]
        if d.get("disagg_decode_enable_radix_cache", False):
            decode.append("--disaggregation-decode-enable-radix-cache")
        flags: dict[str, list[str]] = {}
        for role, mode in (("prefill", prefill), ("decode", decode)):
            out = list(base)
            if ep[role]:
                out += self._split(m.get("ep_flags", ""))
            if self.mtp > 0:  # both roles: the draft layers take part in prefill too
                out += self._split(m.get("mtp_flags", ""))
                out += ["--speculative-num-steps", str(self.mtp)]
                out += ["--speculative-num-draft-tokens", str(self.mtp + 1)]
            if dp[role]:
                dp_flags = self._split(m.get("dp_flags", ""))
                if "--enable-dp-attention" not in dp_flags:
                    raise RowRefused(
                        f"{self.row_id}: {role}: dp-attn with models.yaml {self.entry_key}'s "
                        "dp_flags lacking --enable-dp-attention: SGLang would run the --dp-size "
                        "ranks as full copies, on GPUs the scripts do not reserve"
                    )
                out += dp_flags
            out += mode
            flags[role] = out
        if self.hicache:
            h = AGENTIC_HICACHE
            for role in flags:
                flags[role] = [a for a in flags[role] if a != "--disable-radix-cache"]
            flags["prefill"] += [
                *("--page-size", h["page_size"], "--enable-hierarchical-cache"),
                *("--hicache-ratio", h["ratio"], "--hicache-io-backend", h["io_backend"]),
                *("--hicache-mem-layout", h["mem_layout"]),
                *("--hicache-write-policy", h["write_policy"]),
                *("--hicache-storage-prefetch-policy", h["prefetch_policy"]),
            ]
            flags["decode"] += ["--page-size", h["page_size"]]
        for role in flags:
            flags[role] = [a for a in flags[role] if a not in _OWNED]
            flags[role] = ["--disaggregation-ib-device", self.ib, *flags[role]]
        return flags, backend

    # -- env -----------------------------------------------------------------------------------

    def _env(
        self, roles: Mapping[str, Mapping[str, Any]]
    ) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """The deployment's env (env.sh, the runner's) and each role's (its command line)."""
        dsv4 = self.model_name == DSV4
        env = {**SGLANG_ENV, "NCCL_IB_HCA": self.ib, "MORI_RDMA_TC": MORI_RDMA_TC}
        # MoRI-IO send queue: env.sh's defaults, the agentic script's exports, DSv4's pin
        env["MORI_IO_SQ_BACKOFF_TIMEOUT_US"] = "500000" if self.agentic else "50000"
        env["MORI_IO_QP_MAX_SEND_WR"] = "32768" if self.agentic else "16384"
        dispatch_prefill, dispatch_decode = 8192, 512
        moe_prefill: str | None = "32768"
        moe_decode: str | None = "2703"
        combine_prefill = combine_decode = ""
        threshold = dispatch_decode * 2
        per_rank_prefill: int | None = None
        per_rank_decode: int | None = None
        if dsv4:
            env.update(DSV4_ENV)
            env["MORI_IO_QP_MAX_SEND_WR"] = "32767"
            combine_prefill = combine_decode = "auto"
            dispatch_prefill, dispatch_decode = 8192, 64
            moe_prefill = moe_decode = None
            per_rank_prefill, per_rank_decode = 16384, 128
            threshold = 4096
        if roles["decode"].get("dp_attention") and "expert_parallel" in roles["decode"]:
            dispatch_decode = self.max_conc // int(roles["decode"]["tensor_parallel"])
            threshold = dispatch_decode * 2
        if self.mtp > 0:
            dispatch_decode *= self.mtp + 1
        env["SGLANG_MORI_DISPATCH_INTER_KERNEL_SWITCH_THRESHOLD"] = str(threshold)
        prefill = {"SGLANG_MORI_COMBINE_DTYPE": combine_prefill}
        if self.two_batch:
            prefill["MORI_ENABLE_SDMA"] = "true"
        if moe_prefill is not None:
            prefill["SGLANG_MORI_MOE_MAX_INPUT_TOKENS"] = moe_prefill
        prefill["SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(
            per_rank_prefill or dispatch_prefill
        )
        decode = {"SGLANG_MORI_COMBINE_DTYPE": combine_decode}
        if moe_decode is not None:
            decode["SGLANG_MORI_MOE_MAX_INPUT_TOKENS"] = moe_decode
        decode["SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(
            per_rank_decode or dispatch_decode
        )
        if self.mtp > 0 and self.agentic and dsv4 and self.mtp in DSV4_GOLDEN_AL:
            decode["SGLANG_SIMULATE_ACC_LEN"] = DSV4_GOLDEN_AL[self.mtp]
            decode["SGLANG_SIMULATE_ACC_METHOD"] = "match-expected"
            decode["SGLANG_SIMULATE_ACC_TOKEN_MODE"] = "real-draft-token"
        return env, {"prefill": prefill, "decode": decode}

    # -- the spec ------------------------------------------------------------------------------

    def _client(self, served: str) -> list[str]:
        if self.agentic:
            self.report(
                "benchmark",
                "agentic trace replay (trace_replay.sh, aiperf in its own container) is not "
                f"run: the client sends a short loadgen --chat smoke load at concurrency "
                f"{self.max_conc}",
            )
            concs, isl, osl, mult = [self.max_conc], 128, 128, 5
        else:
            self.report(
                "benchmark",
                "run as the client: slurmgate loadgen --chat with the row's ISL, OSL and "
                "concurrencies, 10 prompts per concurrency step (random prompts; not "
                "bench.sh's tokenizer-exact ones)",
            )
            concs = [int(c) for c in self.row["conc"]]
            isl, osl, mult = int(self.row["isl"]), int(self.row["osl"]), 10
        loops = " ".join(str(c) for c in concs)
        script = (
            f'for c in {loops}; do python -m slurmgate.cli loadgen "${{OPENAI_BASE_URL%/v1}}" '
            f"--chat --model {shlex.quote(served)} --concurrency $c --requests $((c * {mult})) "
            f"--prompt-tokens {isl} --output-tokens {osl} || exit 1; done"
        )
        return ["sh", "-c", script]

    def spec(self, model: str | None, name: str | None) -> RowSpec:
        roles = {role: self._role(role) for role in ("prefill", "decode")}
        flags, backend = self._flags(roles)
        env, role_env = self._env(roles)
        for role in roles:
            roles[role]["args"] = flags[role]
            roles[role]["env"] = role_env[role]
        served = str(self.config["model"])
        deployment_name = _slug(name) if name else _row_name(self.row_id)
        deployment = {
            "name": deployment_name,
            "engine": "sglang",
            "command": [
                *("python3", "-m", "sglang.launch_server", "--model-path"),
                model or DEFAULT_MODEL,
                *("--served-model-name", served, "--trust-remote-code"),
            ],
            "roles": roles,
            "kv_transfer": backend,
            "frontend": {
                "type": "sglang-router",
                "args": ROUTER_AGENTIC if self.agentic else ROUTER_DI,
                "env": {"NO_COLOR": "1"},
            },
            # server_sglang.sh's SYNC_BARRIER_TIMEOUT for the servers to come up
            "startup_timeout_s": 3000.0 if DSV4 in self.model_name else 1800.0,
            "env": env,
        }
        top = {
            "schema_version": 1,
            "name": deployment_name,
            "gpus_per_node": GPUS_PER_NODE,
            "time_limit": TIME_LIMIT,
            "client": {"command": self._client(served)},
            "deployments": [deployment],
        }
        self.report("image", f"{self.config['image']}: " + REPORTED["image"])
        router = self.config.get("router") or {}
        if router.get("version"):
            self.report("router", f"{router.get('version')}: " + REPORTED["router"])
        for key in (
            "model path",
            "--host 0.0.0.0 --port 8000",
            "setup_deps.sh",
            "IBDEVICES auto-detection",
            "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME",
            "PYTHONPATH",
            "rdma_check.sh",
            "node_excludes.yaml",
        ):
            self.report(key)
        if "CLIENT_IMAGE" in self.settings:
            self.report(
                "CLIENT_IMAGE",
                f"{self.settings['CLIENT_IMAGE']}: the agentic client's container is not run",
            )
        try:
            spec = AllocationSpec.from_data(top, source=self.row_id)
        except SpecError as exc:
            raise RowRefused(
                f"{self.row_id}: the scripts' workers do not make a valid spec:\n{exc}"
            ) from None
        return RowSpec(spec=spec, row_id=self.row_id, reported=self.reported)


def _row_name(row_id: str) -> str:
    """A name of at most 40 characters that keeps the row's index: the key shortened."""
    key, _, index = row_id.rpartition("#")
    return f"{_slug(key)[: 39 - len(index)].rstrip('-')}-{index}"


def _slug(text: str) -> str:
    slug = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]+", "-", text.lower())).strip("-")
    if not slug or not slug[0].isalpha():
        slug = f"row-{slug}".strip("-")
    return slug[:40].rstrip("-")
