"""A srt-slurm recipe as an allocation spec: what it honours, reports or refuses, by name.

`spec_from_recipe` reads a recipe of either schema (`slurmgate.runtime.spec.recipes`) and builds the
`AllocationSpec` that runs the same workers: one deployment whose roles are the recipe's
prefill and decode (or agg) workers in the engine's own sizes, its engine flags and env, the
frontend it names (Dynamo's, the SGLang router, trtllm-serve) and a client that drives the
endpoint with the recipe's benchmark shape. Every key is either honoured, reported (run
differently, and said so: `Reported`), or refused (`RecipeRefused`, naming the key and why);
none is dropped silently. What is reported and what is refused is in `REPORTED` and
`REFUSED`, and docs/spec.md's neighbour README section says why.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmgate.errors import InputError
from slurmgate.runtime.spec import recipe_client, recipes, variants
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError

DEFAULT_MODEL = "/model"  # where srtctl mounts the recipe's model in its container
_SLUG = re.compile(r"[^a-z0-9-]+")

# Keys that change how the job runs in ways slurmgate does not do, but whose absence leaves the
# served model and its workers the same: run without them, and say so.
REPORTED = {
    "model.container": "the deployment's container, as pyxis runs it (srt-slurm's "
    "--container-image, --no-container-entrypoint, --no-container-mount-home)",
    "model.path": "an alias srt-slurm resolves through srtslurm.yaml; the spec loads the "
    "path given with --model (default /model, where srtctl mounts it)",
    "model.precision": "informational: the engine flags say how the model is served",
    "dynamo": "Dynamo is used as installed on the nodes (no per-job install from a hash, "
    "wheel or version)",
    "frontend.enable_multiple_frontends": "one frontend behind slurmgate's logical endpoint "
    "(no nginx in front of several)",
    "frontend.num_additional_frontends": "one frontend (no nginx)",
    "frontend.nginx_container": "no nginx",
    "frontend.nginx_session_affinity": "no nginx: the logical endpoint routes",
    "frontend.nginx_session_affinity_header": "no nginx: the logical endpoint routes",
    "infra.etcd_nats_dedicated_node": "etcd and NATS run on the client node, not a node of "
    "their own (the node count stays the recipe's prefill + decode nodes)",
    "infra.nats_max_payload_mb": "NATS runs with its default max_payload",
    "resources.gpu_type": "informational: the pool's runners decide the hardware",
    "resources.het_jobs": "one homogeneous allocation (no Slurm heterogeneous components)",
    "sbatch_directives": "the allocation is asked for by slurmgate (spec.slurm for partition, "
    "account, QOS, reservation, constraint)",
    "srun_options": "the steps' srun options are slurmgate's own",
    "health_check": "honoured as startup_timeout_s = max_attempts × interval_seconds",
    "identity": "informational (model and container provenance)",
    "telemetry": "no power/GPU telemetry collectors",
    "enable_config_dump": "no engine config dumps",
    "benchmark": recipe_client.SA_BENCH_REPORTED,
    "backend.dp_launch_mode": "vLLM data parallelism is launched per node (srt-slurm's default)",
    "backend.kv_events_config": "no KV-event publishing (KV-aware routing falls back)",
    "backend.connector": "the roles' own --kv-transfer-config, or kv_transfer, decides",
    "slurm.time_limit": "honoured as the spec's time_limit",
    "profiling": "no profiling (type none only)",
    "setup_script": "run with bash inside the container, once per node before its workers "
    "start, as /configs/NAME (srt-slurm's configs directory, mounted from --workspace); a "
    "script that is missing or fails fails the node (srt-slurm only warns when it is missing)",
    "extra_mount": "the container's mounts: a relative source under --workspace (srt-slurm's "
    "checkout on the nodes), tmpfs as pyxis's tmpfs",
}
# srt-slurm's other backend keys (its BackendProtocol's), and what a run does instead.
BACKEND_REPORTED = {
    "publish_metrics": "not passed: the workers publish no Dynamo metrics of their own",
    "publish_events_and_metrics": "not passed: no KV events or metrics from the workers "
    "(KV-aware routing falls back)",
    "sequential_node_start": "workers start together, paced by rank_launch_stagger_s and "
    "lead_boot_standoff_s, not in readiness-gated batches",
    "numa_memory_bind": "no numactl prefix: srt-slurm binds TensorRT-LLM workers only",
    "numa_cpu_bind": "no CPU binding beyond Slurm's",
    "served_model_name": "the spec's served model name is the recipe's model name",
}
_ROLE_PARTS = ("environment", "extra_args")
# srt-slurm's memory binding of a TensorRT-LLM worker (src/srtctl/backends/trtllm.py at
# c88ef731, `build_worker_command`): on by default on gb200/gb300, for prefill and decode only.
NUMACTL = ("numactl", "-m", "0,1")


def _numactl(
    backend: Mapping[str, Any], resources: Mapping[str, Any], roles: Mapping[str, Any], b: _Build
) -> bool:
    """Whether a TensorRT-LLM recipe's workers start under `numactl -m 0,1`, as srt-slurm
    decides it; reported, since here only a worker over several nodes has a launcher to prefix."""
    bind = backend.get("numa_memory_bind")
    disaggregated = "agg" not in roles
    on = disaggregated and (
        bool(bind) if bind is not None else resources.get("gpu_type") in ("gb200", "gb300")
    )
    if on or bind is not None:
        b.report(
            "backend.numa_memory_bind",
            f"{'numactl -m 0,1' if on else 'no numactl'}, as srt-slurm decides it (default on "
            "gb200/gb300, prefill and decode only): before trtllm-llmapi-launch on a worker "
            "over several nodes; a one-node worker starts without a launcher, so without it",
        )
    return on


# Keys whose meaning slurmgate cannot reproduce: a run without them would not be that recipe.
REFUSED = {
    "container_mounts": "srt-slurm's templated container mounts ({log_dir}-style paths of its "
    "own run layout)",
    "extra_mount without model.container": "mounts for a container the recipe does not name",
    "backend.mooncake_kv_store.device_names_by_gpu": "per-GPU Mooncake device names: every "
    "lane reads one store config",
    "resources.decode_nodes: 0": "decode workers colocated on the prefill nodes",
    "frontend.type: vllm with several workers": "direct vllm serve runs one worker",
    "frontend.type: sglang (schema 2) with several workers": "srt-slurm 2.x's router-free "
    "sglang frontend runs one aggregated worker (sglang-router spreads over several)",
    "backend.type: mocker": "Dynamo's mocker engine is not modelled",
    "environment templating": "{node} / {node_id} placeholders in environment values",
}
_KNOWN_TOP = {
    "schema",
    "name",
    "model",
    "resources",
    "backend",
    "frontend",
    "dynamo",
    "benchmark",
    "health_check",
    "infra",
    "environment",
    "slurm",
    "sbatch_directives",
    "srun_options",
    "identity",
    "telemetry",
    "profiling",
    "enable_config_dump",
    "setup_script",
    "container_mounts",
    "extra_mount",
    "output",
    "observability",
    "reporting",
}
# Role-config keys the launcher owns, lifted into the role's fields or replaced by the layout.
_SIZE_KEYS = {
    "tensor-parallel-size": "tensor_parallel",
    "tp-size": "tensor_parallel",
    "tp": "tensor_parallel",
    "data-parallel-size": "data_parallel",
    "dp-size": "data_parallel",
    "dp": "data_parallel",
    "expert-parallel-size": "expert_parallel",
    "ep-size": "expert_parallel",
    "ep": "expert_parallel",
    "pipeline-parallel-size": "pipeline_parallel",
    "pp-size": "pipeline_parallel",
}
_LAYOUT_KEYS = (
    "host",
    "port",
    "nnodes",
    "node-rank",
    "dist-init-addr",
    "headless",
    "master-addr",
    "master-port",
    "disaggregation-bootstrap-port",
    "data-parallel-rpc-port",
    "data-parallel-size-local",
    "data-parallel-start-rank",
    "data-parallel-hybrid-lb",
    "data-parallel-address",
    "nccl-port",
)
_TRTLLM_SIZE_KEYS = {
    "tensor_parallel_size": "tensor_parallel",
    "pipeline_parallel_size": "pipeline_parallel",
    "moe_expert_parallel_size": "expert_parallel",
}


class RecipeRefused(InputError):
    """A recipe key slurmgate cannot honour; the message names it and why."""


@dataclass(frozen=True)
class Reported:
    """A recipe key that runs differently under slurmgate, and how."""

    key: str
    how: str

    def line(self) -> str:
        return f"{self.key}: {self.how}"


@dataclass
class RecipeSpec:
    """The spec a recipe becomes, and what of the recipe it runs differently."""

    spec: AllocationSpec
    schema: int
    reported: list[Reported] = field(default_factory=list)

    def yaml(self, source: str) -> str:
        """The spec as YAML, headed by comments naming the recipe and every reported key."""
        import yaml

        data = self.spec.model_dump(mode="json", exclude_defaults=True)
        head = [f"# From the srt-slurm recipe {source} (schema {self.schema})."]
        head += [f"# reported: {r.line()}" for r in self.reported]
        return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, width=100)


def _slug(text: Any, fallback: str) -> str:
    slug = _SLUG.sub("-", str(text).lower()).strip("-")
    slug = re.sub(r"-+", "-", slug)
    if not slug or not slug[0].isalpha():
        slug = f"{fallback}-{slug}".strip("-")
    return slug[:40].rstrip("-") or fallback


def _flags(config: Mapping[str, Any]) -> list[str]:
    """srt-slurm's `_config_to_cli_args`: sorted keys as --key value, true as a bare flag,
    false and null left out, a list as repeated values; a mapping is passed as JSON."""
    argv: list[str] = []
    for key, value in sorted(config.items()):
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


@dataclass
class _Build:
    source: str
    reported: list[Reported] = field(default_factory=list)

    def report(self, key: str, how: str | None = None) -> None:
        self.reported.append(Reported(key, how or REPORTED.get(key, "not used")))

    def refuse(self, key: str, why: str | None = None) -> RecipeRefused:
        return RecipeRefused(f"{self.source}: {key}: cannot be honoured — {why or REFUSED[key]}")


@dataclass(frozen=True)
class Site:
    """What srt-slurm reads from a site's srtslurm.yaml and checkout: its container aliases
    (`containers:`), its checkout on the nodes, and the model's directory there."""

    containers: Mapping[str, str] = field(default_factory=dict)
    workspace: str | None = None
    model_dir: str | None = None
    # the job-mix row's concurrencies (InferenceX's CONC_LIST), for an agentic recipe without
    conc: str | None = None


def spec_from_recipe(
    path: str | Path,
    *,
    model: str | None = None,
    name: str | None = None,
    site: Site | None = None,
) -> RecipeSpec:
    """Read a recipe file and build its spec (see the module docstring); `path` may name one
    variant of a file with a `base:` section, `FILE.yaml:selector` (`variants`)."""
    data = variants.load(path)
    return spec_from_data(data, source=str(path), model=model, name=name, site=site)


def spec_from_data(
    data: Mapping[str, Any],
    *,
    source: str = "recipe",
    model: str | None = None,
    name: str | None = None,
    site: Site | None = None,
) -> RecipeSpec:
    """Build the spec of an already parsed recipe (either schema); a file of variants is
    refused, listing the selectors that name one."""
    if variants.has_variants(data):
        variants.select(data, None, source)
    schema = recipes.schema(data, source)
    r = recipes.expanded(data, source)
    b = _Build(source)
    unknown = sorted(set(r) - _KNOWN_TOP)
    if unknown:
        raise RecipeRefused(
            f"{source}: {', '.join(unknown)}: unknown recipe keys — slurmgate knows the keys "
            "of srt-slurm's schema; remove them or check their spelling"
        )
    if r.get("container_mounts"):
        raise b.refuse("container_mounts")
    model_block = _section(r, "model", source)
    resources = _section(r, "resources", source)
    backend = _section(r, "backend", source)
    frontend = _section(r, "frontend", source)
    kind = recipes.backend_type(r)
    if kind not in ("sglang", "vllm", "trtllm"):
        raise (
            b.refuse("backend.type: mocker")
            if kind == "mocker"
            else RecipeRefused(
                f"{source}: backend.type: {kind!r} is not an engine — use sglang, vllm or trtllm"
            )
        )
    front = frontend.get("type", "dynamo")
    engine = {
        ("dynamo", "sglang"): "dynamo-sglang",
        ("dynamo", "vllm"): "dynamo-vllm",
        ("dynamo", "trtllm"): "dynamo-trtllm",
        ("sglang", "sglang"): "sglang",
        (recipes.SGLANG_SERVER, "sglang"): "sglang",
        ("vllm", "vllm"): "vllm",
        ("vllm-router", "vllm"): "vllm",
        ("trtllm_serve", "trtllm"): "trtllm",
    }.get((front, kind))
    if engine is None:
        raise RecipeRefused(
            f"{source}: frontend.type: {front!r} with backend.type {kind!r} is not a "
            "pairing srt-slurm runs — use dynamo, or the engine's own frontend"
        )
    if resources.get("decode_nodes") == 0:
        raise b.refuse("resources.decode_nodes: 0")
    served = str(model_block.get("path", "model"))
    model_path = model or DEFAULT_MODEL
    for key in ("path", "precision"):
        if key in model_block:
            b.report(f"model.{key}")
    gpn = resources.get("gpus_per_node", 4)
    roles, shared = _roles(r, b, kind, engine, gpn)
    served = shared.pop("served-model-name", served)
    command = _command(engine, model_path, str(served), shared.pop("model", None), b)
    deployment: dict[str, Any] = {
        "name": _slug(name or r.get("name", "recipe"), "recipe"),
        "engine": engine,
        "command": command,
        "roles": roles,
    }
    if shared.get("kv_transfer"):
        deployment["kv_transfer"] = shared["kv_transfer"]
    container = _container(r, model_block, b, site, model_path)
    if container is not None:
        deployment["container"] = container
    if kind == "trtllm" and _numactl(backend, resources, roles, b):
        deployment["mpi_launch"] = [*NUMACTL, "trtllm-llmapi-launch"]
    store = backend.get("mooncake_kv_store")
    if store:
        _mooncake(deployment, store, b)
    _frontend(deployment, frontend, front, r, b)
    health = _section(r, "health_check", source)
    attempts, interval = health.get("max_attempts", 180), health.get("interval_seconds", 10)
    deployment["startup_timeout_s"] = float(attempts) * float(interval)
    if "health_check" in r:
        b.report("health_check")
    env = _section(r, "environment", source)
    if any("{node" in str(v) for v in env.values()):
        raise b.refuse("environment templating")
    if env:
        deployment["env"] = {
            **deployment.get("env", {}),
            **{str(k): str(v) for k, v in env.items()},
        }
    top: dict[str, Any] = {
        "schema_version": 1,
        "name": deployment["name"],
        "gpus_per_node": gpn,
        "client": {"command": _client(r, b, str(served), model_path, (site or Site()).conc)},
        "deployments": [deployment],
    }
    slurm = _section(r, "slurm", source)
    if slurm.get("time_limit") is not None:
        top["time_limit"] = str(slurm["time_limit"])
        b.report("slurm.time_limit")
    _report_rest(r, b)
    try:
        spec = AllocationSpec.from_data(top, source=source)
    except SpecError as exc:
        raise RecipeRefused(
            f"{source}: the recipe's workers do not make a valid spec:\n{exc}"
        ) from None
    configs = [path for d in spec.deployments for path in d.config_paths]
    if configs:
        b.report(
            "/configs paths",
            f"{', '.join(dict.fromkeys(configs))}: srt-slurm mounts its configs directory at "
            "/configs in the container; here they must exist on every node, and preflight "
            "checks each as it checks the model path",
        )
    return RecipeSpec(spec=spec, schema=schema, reported=b.reported)


def _container(
    r: Mapping[str, Any],
    model_block: Mapping[str, Any],
    b: _Build,
    site: Site | None,
    model_path: str,
) -> dict[str, Any] | None:
    """The recipe's container as srt-slurm runs it (src/srtctl/core/runtime.py at c88ef731):
    the image (an alias through the site's `containers:`), the model at /model, the checkout's
    configs directory at /configs, the recipe's extra mounts; its setup script inside."""
    site = site or Site()
    raw = model_block.get("container")
    image = raw.get("image") if isinstance(raw, dict) else raw
    extra = r.get("extra_mount") or []
    if not isinstance(extra, list) or not all(isinstance(m, str) for m in extra):
        raise RecipeRefused(f"{b.source}: extra_mount: give a list of HOST:CONTAINER strings")
    if not image:
        if extra:
            raise b.refuse("extra_mount without model.container")
        if r.get("setup_script"):
            b.report("setup_script", "not run: the recipe names no container to run it in")
        return None
    if not isinstance(image, str):
        raise RecipeRefused(f"{b.source}: model.container: give the image as a string")
    aliased = site.containers.get(image)
    b.report(
        "model.container",
        REPORTED["model.container"]
        + (f"; {image!r} is the site's alias of {aliased}" if aliased else ""),
    )
    mounts = []
    if site.model_dir:
        mounts.append(f"{site.model_dir}:{model_path}")
    else:
        b.report("model.path", f"mount the model at {model_path} (--model-dir on the nodes)")
    if site.workspace:
        mounts.append(f"{site.workspace.rstrip('/')}/configs:/configs")
    for entry in extra[: 64 - len(mounts)]:
        host, _, inside = entry.partition(":")
        if not inside:
            raise RecipeRefused(f"{b.source}: extra_mount: {entry!r} is not HOST:CONTAINER")
        if host == "tmpfs" or host.startswith("/"):
            mounts.append(f"{host}:{inside}")
        elif site.workspace and "$" not in host and not host.startswith("~"):
            mounts.append(f"{site.workspace.rstrip('/')}/{host.removeprefix('./')}:{inside}")
        else:
            b.report("extra_mount", f"{entry!r} not mounted: its source is relative to srt-slurm's "
                     "checkout: give --workspace")  # fmt: skip
            continue
    if extra:
        b.report("extra_mount")
    container: dict[str, Any] = {"image": aliased or image, "mounts": mounts}
    script = r.get("setup_script")
    if script:
        if not isinstance(script, str) or "/" in script or not script.strip():
            raise RecipeRefused(f"{b.source}: setup_script: give a file name in configs/")
        container["setup_script"] = f"/configs/{script}"
        b.report("setup_script", f"{script!r}: " + REPORTED["setup_script"])
    return container


def _mooncake(deployment: dict[str, Any], store: Any, b: _Build) -> None:
    """srt-slurm's `backend.mooncake_kv_store` as the deployment's `mooncake`: its store_config
    (the workers' JSON), the master's extra args, and its env on every worker, as srt-slurm
    gives it. srt-slurm's master answers other nodes unauthenticated: so does this one
    (`across_hosts`), and the run reports it."""
    if not isinstance(store, dict):
        raise RecipeRefused(f"{b.source}: backend.mooncake_kv_store: not a mapping")
    if store.get("device_names_by_gpu"):
        raise b.refuse("backend.mooncake_kv_store.device_names_by_gpu")
    config = store.get("store_config") or {}
    if not isinstance(config, dict) or not all(
        isinstance(v, str | int | float | bool) for v in config.values()
    ):
        raise RecipeRefused(
            f"{b.source}: backend.mooncake_kv_store.store_config: give KEY: VALUE lines with "
            "plain values (strings, numbers, booleans)"
        )
    config = {str(k): v for k, v in config.items() if k != "master_server_address"}
    spec: dict[str, Any] = {"store_config": config, "across_hosts": True}
    if store.get("master_extra_args"):
        spec["master_args"] = [str(a) for a in store["master_extra_args"]]
    deployment["mooncake"] = spec
    if store.get("env"):
        deployment["env"] = {str(k): str(v) for k, v in dict(store["env"]).items()}
    if store.get("container"):
        b.report("backend.mooncake_kv_store.container", "the nodes' own mooncake_master runs")
    b.report(
        "backend.mooncake_kv_store",
        "Mooncake's master and HTTP metadata server run on the client node before the workers "
        "(mooncake.across_hosts: true, as srt-slurm runs them: on its address, without "
        "authentication, when workers run on other nodes); every worker gets MOONCAKE_MASTER, "
        "MOONCAKE_TE_META_DATA_SERVER and the store's JSON at MOONCAKE_CONFIG_PATH",
    )


def _section(r: Mapping[str, Any], key: str, source: str) -> dict[str, Any]:
    value = r.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RecipeRefused(f"{source}: {key}: not a mapping — write it as KEY: VALUE lines")
    return value


def _roles(
    r: Mapping[str, Any], b: _Build, kind: str, engine: str, gpn: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each role of the recipe as a RoleSpec's data; and what the roles share (the served name,
    the transfer backend, the model) lifted out of their flags."""
    resources = dict(r.get("resources") or {})
    backend = dict(r.get("backend") or {})
    config_key = recipes.ENGINE_CONFIG_KEY[kind]
    configs = dict(backend.get(config_key) or {})
    present = [role for role in recipes.ROLE_NAMES if resources.get(f"{role}_nodes") is not None]
    if not present:
        raise RecipeRefused(
            f"{b.source}: resources: gives neither agg_nodes nor prefill_nodes and "
            "decode_nodes — add the node counts"
        )
    roles: dict[str, Any] = {}
    shared: dict[str, Any] = {}
    lifted: dict[str, set[str]] = {"served-model-name": set(), "kv_transfer": set(), "model": set()}
    for role in present:
        mode = recipes.ROLE_TO_MODE[role]
        nodes = resources[f"{role}_nodes"]
        workers = resources.get(f"{role}_workers", 1)
        gpus = resources.get(f"gpus_per_{role}")
        if gpus is None:
            if not isinstance(nodes, int) or not isinstance(workers, int) or workers < 1:
                raise RecipeRefused(f"{b.source}: resources.{role}_nodes/_workers: not counts")
            gpus = nodes * gpn // workers
        spec: dict[str, Any] = {"workers": workers, "gpus_per_worker": gpus}
        if resources.get("spread_workers") and gpus < gpn:
            spec["workers_per_node"] = 1
        config = dict(configs.get(mode) or {})
        if kind == "trtllm":
            _trtllm_role(spec, config, role, lifted, b)
        else:
            _flag_role(spec, config, role, kind, lifted, b)
        env = backend.get(f"{mode}_environment") or {}
        if env:
            spec["env"] = {str(k): str(v) for k, v in env.items()}
        extra = backend.get(f"{mode}_extra_args") or []
        if extra:
            spec["args"] = [*spec.get("args", []), *(str(a) for a in extra)]
        roles[role] = spec
        planned = _planned_nodes(spec, gpn)
        if planned is not None and planned != nodes:
            raise RecipeRefused(
                f"{b.source}: resources.{role}_nodes: {nodes}, but {workers} worker(s) of "
                f"{gpus} GPUs on {gpn}-GPU nodes take {planned} — fix the recipe's node count"
            )
    for key, values in lifted.items():
        if len(values) > 1:
            raise RecipeRefused(
                f"{b.source}: {key}: the roles disagree ({', '.join(sorted(values))}) — "
                "slurmgate gives one value to the whole deployment"
            )
        if values:
            shared[key] = values.pop()
    return roles, shared


def _planned_nodes(spec: Mapping[str, Any], gpn: int) -> int | None:
    gpus, workers = spec["gpus_per_worker"], spec["workers"]
    if not isinstance(gpus, int) or not isinstance(workers, int) or gpus < 1 or gpn < 1:
        return None
    if gpus > gpn:
        return workers * -(-gpus // gpn)
    per = int(spec.get("workers_per_node") or gpn // gpus)
    return -(-workers // per)


def _flag_role(
    spec: dict[str, Any],
    config: dict[str, Any],
    role: str,
    kind: str,
    lifted: dict[str, set[str]],
    b: _Build,
) -> None:
    for key, fieldname in _SIZE_KEYS.items():
        if key in config:
            spec[fieldname] = config.pop(key)
    config.pop("enable-metrics", None)  # the launcher always turns SGLang's metrics on
    if config.pop("enable-dp-attention", False):
        spec["dp_attention"] = True
    if kind == "vllm" and config.pop("enable-expert-parallel", False):
        spec["expert_parallel"] = spec.get("tensor_parallel", 1) * spec.get("data_parallel", 1)
    mode = config.pop("disaggregation-mode", None)
    if mode is not None and mode != role:
        raise RecipeRefused(
            f"{b.source}: {role}: disaggregation-mode is {mode!r} in the {role} role's config "
            f"— it must be {role}"
        )
    for key in _LAYOUT_KEYS:
        if key in config:
            value = config.pop(key)
            if value is not None:
                b.report(f"{role}.{key}", f"{value!r} replaced: the layout assigns it")
    backend = config.pop("disaggregation-transfer-backend", None)
    if backend is not None:
        lifted["kv_transfer"].add(str(backend))
    for key in ("model-path", "model"):
        if key in config:
            lifted["model"].add(str(config.pop(key)))
    if "served-model-name" in config:
        lifted["served-model-name"].add(str(config.pop("served-model-name")))
    if "kv-transfer-config" in config:
        value = config.pop("kv-transfer-config")
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        spec["args"] = ["--kv-transfer-config", text]
    spec["args"] = [*spec.get("args", []), *_flags(config)]
    if not spec["args"]:
        del spec["args"]


def _trtllm_role(
    spec: dict[str, Any],
    config: dict[str, Any],
    role: str,
    lifted: dict[str, set[str]],
    b: _Build,
) -> None:
    for key, fieldname in _TRTLLM_SIZE_KEYS.items():
        if key in config:
            spec[fieldname] = config.pop(key)
    if config.pop("enable_attention_dp", False):
        if spec.get("tensor_parallel", 1) > 1:
            spec["dp_attention"] = True
            spec["data_parallel"] = spec.get("tensor_parallel", 1)
        else:
            b.report(f"{role}.enable_attention_dp", "off: over one TP rank it changes nothing")
    transceiver = config.get("cache_transceiver_config")
    if isinstance(transceiver, dict) and "backend" in transceiver:
        lifted["kv_transfer"].add(str(transceiver["backend"]))
        rest = {k: v for k, v in transceiver.items() if k != "backend"}
        if rest:
            config["cache_transceiver_config"] = rest
        else:
            del config["cache_transceiver_config"]
    if config:
        spec["engine_config"] = config


def _command(engine: str, model: str, served: str, own: str | None, b: _Build) -> list[str]:
    if own is not None and own != model:
        b.report("model-path", f"the roles' {own!r} replaced by {model!r} (--model)")
    name = ["--served-model-name", served]
    return {
        "dynamo-sglang": ["python3", "-m", "dynamo.sglang", "--model-path", model, *name],
        "dynamo-vllm": ["python3", "-m", "dynamo.vllm", "--model", model, *name],
        "dynamo-trtllm": ["python3", "-m", "dynamo.trtllm", "--model-path", model, *name],
        "sglang": ["python3", "-m", "sglang.launch_server", "--model-path", model, *name],
        "vllm": ["vllm", "serve", model, *name],
        "trtllm": ["trtllm-serve", model],
    }[engine]


def _frontend(
    deployment: dict[str, Any],
    frontend: Mapping[str, Any],
    front: str,
    r: Mapping[str, Any],
    b: _Build,
) -> None:
    # schema-1 names (`expanded` renames schema 2's): srt-slurm 1.x's `sglang` is the router
    kinds = {
        "dynamo": "dynamo",
        "sglang": "sglang-router",
        "vllm-router": "vllm-router",
        "trtllm_serve": "trtllm-serve",
    }
    roles = deployment["roles"]
    if front in ("vllm", recipes.SGLANG_SERVER):  # the engine's own server, no router
        if set(roles) != {"agg"} or roles["agg"]["workers"] != 1:
            shown = "sglang (schema 2)" if front == recipes.SGLANG_SERVER else front
            raise b.refuse(f"frontend.type: {shown} with several workers")
    else:
        spec: dict[str, Any] = {"type": kinds[front]}
        args = frontend.get("args") or {}
        if args:
            spec["args"] = _flags(args)
        env = frontend.get("env") or {}
        if env:
            spec["env"] = {str(k): str(v) for k, v in env.items()}
        plane = (r.get("dynamo") or {}).get("request_plane")
        if front == "dynamo" and plane is not None:
            spec["request_plane"] = plane
        deployment["frontend"] = spec
    for key in (
        "enable_multiple_frontends",
        "num_additional_frontends",
        "nginx_container",
        "nginx_session_affinity",
        "nginx_session_affinity_header",
    ):
        if frontend.get(key):
            b.report(f"frontend.{key}")
    for key in sorted(set(frontend) - {"type", "args", "env", *REPORTED_FRONTEND}):
        b.report(f"frontend.{key}", "not used")


REPORTED_FRONTEND = (
    "enable_multiple_frontends",
    "num_additional_frontends",
    "nginx_container",
    "nginx_session_affinity",
    "nginx_session_affinity_header",
)


def _client(
    r: Mapping[str, Any], b: _Build, served: str, tokenizer: str, conc: str | None
) -> list[str]:
    """The client's command (`recipe_client`), its benchmark reported with how it runs."""
    try:
        command, how = recipe_client.client_command(r, served, tokenizer, conc)
    except ValueError as exc:
        raise RecipeRefused(f"--conc: {exc}") from None
    b.report("benchmark", how)
    return command


def _report_rest(r: Mapping[str, Any], b: _Build) -> None:
    """Every remaining key the spec does not carry, reported by name."""
    for key in ("dynamo", "sbatch_directives", "srun_options", "identity", "enable_config_dump"):
        if r.get(key):
            b.report(key)
    telemetry = r.get("telemetry") or {}
    if isinstance(telemetry, dict) and telemetry.get("enabled"):
        b.report("telemetry")
    profiling = r.get("profiling") or {}
    if isinstance(profiling, dict) and profiling.get("type", "none") != "none":
        raise RecipeRefused(
            f"{b.source}: profiling.type: {profiling.get('type')!r}: cannot be honoured — "
            "slurmgate runs no profiler; remove profiling or set type: none"
        )
    infra = r.get("infra") or {}
    for key in ("etcd_nats_dedicated_node", "nats_max_payload_mb"):
        if isinstance(infra, dict) and infra.get(key):
            b.report(f"infra.{key}")
    resources = r.get("resources") or {}
    for key in ("gpu_type", "het_jobs"):
        if resources.get(key):
            b.report(f"resources.{key}")
    backend = r.get("backend") or {}
    for key in ("dp_launch_mode", "kv_events_config"):
        if backend.get(key):
            b.report(f"backend.{key}")
    if "connector" in backend:
        b.report("backend.connector")
    consumed = {"type", "mooncake_kv_store", "dp_launch_mode", "kv_events_config", "connector"}
    if recipes.backend_type(r) == "trtllm":
        consumed.add("numa_memory_bind")  # reported where the deployment is built (`_numactl`)
    consumed |= set(recipes.ENGINE_CONFIG_KEY.values())
    consumed |= {f"{role}_{part}" for role in recipes.ROLE_NAMES for part in _ROLE_PARTS}
    for key in sorted(set(map(str, backend)) - consumed):
        if backend[key] not in (None, False, 0, "", [], {}):
            b.report(f"backend.{key}", BACKEND_REPORTED.get(key, "not used"))
    for key in ("output", "observability", "reporting"):
        if r.get(key):
            b.report(key, "not used: slurmgate writes its own run record and logs")
